"""What every handler needs, built once per app: the engine, its tokenizer, names, limits, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxllm.server.metrics import ServerMetrics
from jaxllm.server.request_log import RequestLogger
from jaxllm.server.research import ResearchLimits, ResearchModel


@dataclass(slots=True)
class ServerState:
    engine: object  # AsyncLLMEngine or anything with its interface
    served_names: list[str]  # the first is reported in responses
    metrics: ServerMetrics
    sampling_defaults: dict = field(default_factory=dict)  # SamplingParams fields for omitted request fields
    chat_template: str | None = None  # overrides the tokenizer's
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    disconnect_poll_s: float = 0.5
    stats_interval_s: float = 10.0
    max_logprobs: int = (
        20  # --max-logprobs: the most logprobs, top_logprobs, prompt_logprobs a request may ask
    )
    start_time: float = field(default_factory=time.time)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" reads calls with tool_call_parser
    tool_call_parser: str | None = None  # a jaxllm.server.tool_parsers.TOOL_PARSERS name
    reasoning_parser: str | None = None  # a jaxllm.server.reasoning.REASONING_PARSERS name
    request_logger: RequestLogger | None = None  # --enable-log-requests: a line per generation request
    research_limits: ResearchLimits = field(default_factory=ResearchLimits)  # --enable-research-api, ...
    research_model: ResearchModel | None = None  # the model's sizes, when it serves research

    def log_request(self, request_id: str, prompt_ids: list[int], params) -> None:
        if self.request_logger is not None:
            self.request_logger.log(request_id, prompt_ids, params, self.engine.tokenizer)

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: the tokenizer's, or the model's when it has no tokenizer."""
        tok = self.engine.tokenizer
        return len(tok) if tok is not None else self.engine.vocab_size

    def require_tokenizer(self, param: str):
        """The tokenizer, or a client error naming `param` when the model has none (random weights)."""
        tok = self.engine.tokenizer
        if tok is None:
            from jaxllm.server.errors import APIError

            raise APIError(f"this model has no tokenizer: '{param}' must be given as token ids", param=param)
        return tok

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_kv_tokens(self) -> int | None:
        """Tokens the engine's whole KV cache holds (None: an engine that does not say)."""
        return getattr(self.engine, "max_kv_tokens", None)

    @property
    def model_name(self) -> str:
        return self.served_names[0]
