"""A deterministic stand-in for `jaxllm.engine.async_engine.AsyncLLMEngine`, with the same interface.

Tokens come from a tiny word-level tokenizer built in-process (ChatML template, nothing downloaded).
Each step draws logits from a hash of the recent context, so greedy output is a pure function of the
prompt; sampling with a seed is reproducible. It honours max_tokens, n, stop strings (holding back text
that could start a stop string, as a real detokenizer must), stop_token_ids, seed, logprobs,
prompt_logprobs, min_tokens, ignore_eos and max_model_len; yields cumulative RequestOutputs with a small
delay per step; abort ends a request's stream; shutdown drains running requests.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = (
    "hello world user assistant system the a cat dog sat on mat and ran fast slow red blue green sky sea "
    "sun moon star tree river stone bird fish sings swims jumps over under big small old new one two three "
    "four five six seven eight nine ten yes no maybe why how what when where who is are was"
).split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    tok.chat_template = CHATML
    return tok


class _Sample:
    def __init__(self, index: int, rng: np.random.Generator):
        self.index = index
        self.rng = rng
        self.token_ids: list[int] = []
        self.text_ids: list[int] = []  # token_ids without the stop/eos token that ended it
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.final_text: str | None = None


class MockAsyncEngine:
    def __init__(self, max_model_len: int = 256, step_delay_s: float = 0.002, model_name: str = "mock-model"):
        self.tokenizer = make_tokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.first_step_delay_s = 0.0  # extra wait before a request's first token (a queue or a long prefill)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self._blocked = [self.tokenizer.convert_tokens_to_ids(s) for s in SPECIALS if s != "<|im_end|>"]
        self.startup_info = {
            "model": model_name,
            "dtype": "float32",
            "num_gpu_blocks": 64,
            "block_size": 16,
            "max_concurrency": 64 * 16 / max_model_len,
            "compile_time_s": 0.0,
        }
        self.sampling_defaults: dict = {}  # the model's generation config, as the real engine exposes it
        self.started = False
        self.abort_calls: list[str] = []
        self._aborted: set[str] = set()
        self._active: set[str] = set()
        self._stats = EngineStats(num_gpu_blocks=64, block_size=16)
        self.iteration_tokens: list[int] = []  # tokens per step (the server's metrics take them)

    # --- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def from_engine_args(cls, args, *, served_model_name: str | None = None) -> MockAsyncEngine:
        return cls(max_model_len=args.max_model_len or 256, model_name=served_model_name or "mock-model")

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        while self._active:  # drain
            await asyncio.sleep(0.005)
        self.started = False

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self._active:
            self._aborted.add(request_id)

    def get_stats(self) -> EngineStats:
        s = self._stats
        s.num_requests_running = len(self._active)
        s.kv_cache_usage = min(1.0, len(self._active) / 64)
        return s

    # --- the model ---------------------------------------------------------------------------------
    def _logits(self, context: list[int]) -> np.ndarray:  # f32[V]
        key = zlib.crc32(np.asarray(context[-6:] + [len(context)], dtype=np.int64).tobytes())
        logits = np.random.default_rng(key).normal(size=self.vocab_size) * 2.0
        logits[self._blocked] = -np.inf
        logits[self.eos_id] = 3.5  # an end-of-sequence now and then
        return logits

    @staticmethod
    def _log_softmax(x: np.ndarray) -> np.ndarray:
        m = np.max(x)
        return x - m - np.log(np.sum(np.exp(x - m)))

    def _position(self, logprobs: np.ndarray, chosen: int, top_n: int) -> dict[int, Logprob]:
        order = np.argsort(-logprobs, kind="stable")
        ranks = np.empty_like(order)
        ranks[order] = np.arange(1, len(order) + 1)
        ids = [chosen] + [int(t) for t in order[:top_n] if int(t) != chosen]
        return {t: Logprob(float(logprobs[t]), int(ranks[t]), self.tokenizer.decode([t])) for t in ids}

    def _choose(self, s: _Sample, params: SamplingParams, logits: np.ndarray) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        z = logits / params.temperature
        if params.top_k and params.top_k > 0:
            z[np.argsort(-z)[params.top_k :]] = -np.inf
        p = np.exp(self._log_softmax(z))
        return int(s.rng.choice(self.vocab_size, p=p / p.sum()))

    # --- generation --------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0):
        if not self.started:
            raise RuntimeError("engine is not running")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids=[] must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids has {len(ids)} tokens; max_model_len={self.max_model_len}")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size})")
        if request_id in self._active:
            raise ValueError(f"request_id={request_id!r} is already running")
        p = sampling_params
        metrics = RequestMetrics(arrival_time=time.time())
        stops = p.stop_list
        hold = max((len(s) for s in stops), default=1) - 1
        samples = [
            _Sample(i, np.random.default_rng([p.seed, i]) if p.seed is not None else np.random.default_rng())
            for i in range(p.n)
        ]
        prompt_logprobs = None
        if p.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                self._position(self._log_softmax(self._logits(ids[:k])), ids[k], p.prompt_logprobs)
                for k in range(1, len(ids))
            ]
        self._active.add(request_id)
        self._stats.prompt_tokens += len(ids)
        try:
            await asyncio.sleep(self.first_step_delay_s)
            metrics.first_scheduled_time = time.time()
            while True:
                await asyncio.sleep(self.step_delay_s)
                if request_id in self._aborted:
                    return
                running = [s for s in samples if s.finish_reason is None]
                for s in running:
                    self._step(s, p, ids)
                self.iteration_tokens.append(
                    len(running) + (len(ids) if metrics.first_token_time is None else 0)
                )
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                done = all(s.finish_reason is not None for s in samples)
                if done:
                    metrics.finished_time = now
                outputs = [self._output(s, p, hold) for s in samples]
                yield RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=list(ids),
                    outputs=outputs,
                    finished=done,
                    prompt_logprobs=prompt_logprobs,
                    metrics=metrics,
                )
                if done:
                    return
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    def _step(self, s: _Sample, p: SamplingParams, prompt_ids: list[int]) -> None:
        context = prompt_ids + s.token_ids
        logits = self._logits(context)
        raw = self._log_softmax(logits)
        stoppers = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stoppers.add(self.eos_id)
        if len(s.token_ids) < p.min_tokens:
            logits[list(stoppers | {self.eos_id})] = -np.inf
        elif p.ignore_eos:
            logits[self.eos_id] = -np.inf
        tid = self._choose(s, p, logits)
        s.token_ids.append(tid)
        s.cumulative_logprob += float(raw[tid])
        if p.logprobs is not None:
            s.logprobs.append(self._position(raw, tid, p.logprobs))
        self._stats.generation_tokens += 1
        if tid in stoppers:
            s.finish_reason, s.stop_reason = "stop", (None if tid == self.eos_id else tid)
        else:
            s.text_ids.append(tid)
            text = self._decode(s.text_ids, p)
            for stop in p.stop_list:
                at = text.find(stop)
                if at >= 0:
                    s.finish_reason, s.stop_reason = "stop", stop
                    s.final_text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                    return
        if s.finish_reason is None and (
            (p.max_tokens is not None and len(s.token_ids) >= p.max_tokens)
            or len(prompt_ids) + len(s.token_ids) >= self.max_model_len
        ):
            s.finish_reason = "length"

    def _decode(self, ids: list[int], p: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)

    def _output(self, s: _Sample, p: SamplingParams, hold: int) -> CompletionOutput:
        if s.final_text is not None:
            text = s.final_text
        else:
            text = self._decode(s.text_ids, p)
            if s.finish_reason is None and hold:
                text = text[: max(0, len(text) - hold)]
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=[dict(x) for x in s.logprobs] if p.logprobs is not None else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
