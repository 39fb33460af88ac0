"""A deterministic stand-in for `jaxllm.engine.async_engine.AsyncLLMEngine`, with the same interface.

Tokens come from a tiny word-level tokenizer built in-process (ChatML template, nothing downloaded).
Each step draws logits from a hash of the recent context, so greedy output is a pure function of the
prompt; sampling with a seed is reproducible. The mock plays the model and the scheduler (max_tokens, n,
stop_token_ids, eos, min_tokens, ignore_eos, max_model_len, as jaxllm.core.scheduler decides them) and
hands every token to the real engine's `OutputProcessor`, so what it yields for each output kind
(CUMULATIVE, DELTA, FINAL_ONLY), stop strings and their hold-back, logprobs and prompt logprobs are what
the engine yields for the same tokens. Outputs come with a small delay per step; abort ends a request's
stream; shutdown drains running requests; `get_stats()` returns an immutable snapshot, republished after
each step, as the real engine's is.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.request import Request, RequestStatus
from jaxllm.runner_output import TokenLogprobs
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats, IterationTokens

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
            "kv_cache_dtype": "float8_e4m3fn",
            "num_gpu_blocks": 64,
            "num_cpu_blocks": 0,
            "block_size": 16,
            "max_concurrency": 64 * 16 / max_model_len,
            "compile_time_s": 0.0,
        }
        self.sampling_defaults: dict = {}  # the model's generation config, as the real engine exposes it
        self.started = False
        self.abort_calls: list[str] = []
        self._aborted: set[str] = set()
        self._active: set[str] = set()
        self._outputs = OutputProcessor(self.tokenizer)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._iterations = IterationTokens()
        self._stats = self._snapshot()

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
        return self._stats

    def _snapshot(self) -> EngineStats:
        buckets, total = self._iterations.snapshot()
        return EngineStats(
            num_requests_running=len(self._active),
            kv_cache_usage=min(1.0, len(self._active) / 64),
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_gpu_blocks=64,
            block_size=16,
            num_steps=self._steps,
            iteration_tokens_buckets=buckets,
            iteration_tokens_sum=total,
        )

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

    @staticmethod
    def _token_logprobs(rows: list[tuple[np.ndarray, int]], top_n: int) -> TokenLogprobs:
        """The runner's shape: per position the chosen token, then the top-N, with 1-based ranks."""
        ids, lps, ranks = [], [], []
        for logprobs, chosen in rows:
            order = np.argsort(-logprobs, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(1, len(order) + 1)
            row = [chosen] + [int(t) for t in order[:top_n]]
            ids.append(row)
            lps.append(logprobs[row])
            ranks.append(rank[row])
        return TokenLogprobs(
            np.asarray(ids, np.int32), np.asarray(lps, np.float32), np.asarray(ranks, np.int32)
        )

    @staticmethod
    def _choose(rng: np.random.Generator, params: SamplingParams, logits: np.ndarray) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        z = logits / params.temperature
        if params.top_k and params.top_k > 0:
            z[np.argsort(-z)[params.top_k :]] = -np.inf
        p = np.exp(MockAsyncEngine._log_softmax(z))
        return int(rng.choice(len(logits), p=p / p.sum()))

    # --- generation --------------------------------------------------------------------------------
    def _prepare(self, request_id: str, prompt, ids: list[int], p: SamplingParams) -> ParentState:
        """As LLMEngine.prepare_request: one Request (and detokenizer) per sample."""
        max_tokens = self.max_model_len - len(ids)
        if p.max_tokens is not None:
            max_tokens = min(p.max_tokens, max_tokens)
        children = []
        for i in range(p.n):
            req = Request(
                request_id=request_id if p.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(ids),
                sampling_params=p,
                eos_token_id=self.eos_id,
                max_tokens=max_tokens,
                status=RequestStatus.RUNNING,
            )
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, ids, p.skip_special_tokens, p.spaces_between_special_tokens
                )
                if p.detokenize
                else None
            )
            children.append(ChildState(req, i, detok))
        prompt_text = prompt if isinstance(prompt, str) else None
        return ParentState(request_id, prompt_text, list(ids), children, RequestMetrics(time.monotonic()))

    async def generate(
        self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
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
        parent = self._prepare(request_id, prompt, ids, p)
        rngs = [
            np.random.default_rng([p.seed, i]) if p.seed is not None else np.random.default_rng()
            for i in range(p.n)
        ]
        self._outputs.add(parent)
        if p.prompt_logprobs is not None:
            rows = [(self._log_softmax(self._logits(ids[:k])), ids[k]) for k in range(1, len(ids))]
            if rows:
                self._outputs.on_prompt_logprobs(
                    parent.children[0].request.request_id, self._token_logprobs(rows, p.prompt_logprobs)
                )
        self._active.add(request_id)
        self._prompt_tokens += len(ids)
        self._stats = self._snapshot()
        try:
            await asyncio.sleep(self.first_step_delay_s)
            parent.metrics.first_scheduled_time = time.monotonic()
            first = True
            while True:
                await asyncio.sleep(self.step_delay_s)
                if request_id in self._aborted:
                    return
                running = [(c, rng) for c, rng in zip(parent.children, rngs) if not c.request.is_finished]
                for c, rng in running:
                    self._step(c.request, rng, ids)
                self._steps += 1
                self._iterations.observe(len(running) + (len(ids) if first else 0))
                first = False
                self._stats = self._snapshot()
                out = self._outputs.make_output(parent)
                if parent.finished:
                    self._outputs.remove(request_id)
                if out is not None:
                    yield out
                if parent.finished:
                    return
        finally:
            self._outputs.remove(request_id)
            self._active.discard(request_id)
            self._aborted.discard(request_id)
            self._stats = self._snapshot()

    def _step(self, req: Request, rng: np.random.Generator, prompt_ids: list[int]) -> None:
        """One token for one sample: the model, then the scheduler's stop checks, then the engine's
        output processing (stop strings end the request as LLMEngine._process does)."""
        p = req.sampling_params
        logits = self._logits(prompt_ids + req.output_token_ids)
        raw = self._log_softmax(logits)
        stoppers = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stoppers.add(self.eos_id)
        if len(req.output_token_ids) < p.min_tokens:
            logits[list(stoppers | {self.eos_id})] = -np.inf
        elif p.ignore_eos:
            logits[self.eos_id] = -np.inf
        tid = self._choose(rng, p, logits)
        req.output_token_ids.append(tid)
        self._generation_tokens += 1
        if tid in stoppers:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None if tid == self.eos_id else tid
        elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
        lp = self._token_logprobs([(raw, tid)], p.logprobs) if p.logprobs is not None else None
        stop = self._outputs.on_tokens(req, [tid], lp)
        if stop is not None and not req.is_finished:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop
