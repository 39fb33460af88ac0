"""The log line of each generation request (--enable-log-requests, as vLLM's): its id, the prompt as text
and as token ids, and its sampling parameters, both cut at --max-log-len.

Off by default, as in vLLM: prompts are users' data and stay out of the logs unless a deployment asks for
them (--disable-log-requests, vLLM's older flag, keeps them out even when both are given). The prompt is
logged after the chat template is applied, so the line shows exactly what the model reads.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("jaxllm.server.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None):
        self.max_log_len = max_log_len  # most prompt characters and token ids shown; None: all

    def log(self, request_id: str, prompt_ids: list[int], params, tokenizer) -> None:
        ids = list(prompt_ids)
        text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else None
        if self.max_log_len is not None:
            ids = ids[: self.max_log_len]
            text = text[: self.max_log_len] if text is not None else None
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text, params, ids
        )
