"""An engine that answers each request with a scripted text, through the real server code path.

The mock engine (mock_engine.py) with the embedded SmolLM2 tokenizer and a script in place of its model:
`script(prompt_text, sampling_params)` gives the output text, which is tokenized and replayed one token
per step (greedy on a one-hot logit row) followed by the end-of-sequence token, through the engine's
OutputProcessor. So the server sees exactly the token-by-token deltas a real model writing that text
would produce (markers like `<tool_call>` or `</think>` arrive split over several tokens), with max_tokens,
stop strings and output kinds applied as the engine applies them. Every request's rendered prompt and
SamplingParams are recorded (`requests`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import load_embedded_tokenizer
from tests.server.mock_engine import MockAsyncEngine


class ScriptedEngine(MockAsyncEngine):
    def __init__(self, script: Callable[[str, SamplingParams], str], max_model_len: int = 2048) -> None:
        super().__init__(max_model_len=max_model_len, step_delay_s=0.0, model_name="scripted-model")
        self.tokenizer = load_embedded_tokenizer()
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self._blocked = []
        self._outputs = OutputProcessor(self.tokenizer)
        self.script = script
        self.requests: list[tuple[str, SamplingParams]] = []  # (rendered prompt, params) per request
        self._replies: dict[str, list[int]] = {}
        self._current = None  # the Request being stepped

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.decode(ids)
        self.requests.append((text, sampling_params))
        reply = self.tokenizer.encode(self.script(text, sampling_params), add_special_tokens=False)
        self._replies[request_id] = reply + [self.eos_id]
        try:
            async for out in super().generate(prompt, sampling_params, request_id, priority=priority):
                yield out
        finally:
            self._replies.pop(request_id, None)

    def _step(self, req, rng, prompt_ids) -> None:
        self._current = req
        super()._step(req, rng, prompt_ids)

    def _logits(self, context: list[int]) -> np.ndarray:  # f32[V]
        req = self._current
        reply = self._replies[req.request_id.split("#")[0]]
        position = min(len(req.output_token_ids), len(reply) - 1)
        logits = np.full(self.vocab_size, -np.inf)
        logits[reply[position]] = 0.0
        return logits
