"""LLMEngine: where the host-side core and the device-side runner meet.

    add_request -> tokenize, validate, fan out n child Requests -> Scheduler.add_request
    step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update_from_output()
             -> OutputProcessor (detokenize, stop strings, logprobs) -> list[RequestOutput]

Start-up (load the model, resolve the configuration, size the KV cache, build the runner and scheduler,
compile, log) is `LLMEngine.from_engine_args`, in engine/builder.py; the engine is handed the built parts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from types import MappingProxyType

from jaxllm.config import EngineConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from jaxllm.engine_args import EngineArgs
from jaxllm.loader import LoadedModel
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.parallel import TensorParallelPlan
from jaxllm.parallel.distributed import DistributedSettings
from jaxllm.request import Request, RequestStatus
from jaxllm.runner import compilation_cache
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.draft_model import DraftModelProposer
from jaxllm.spec_decode.speculator import Speculator
from jaxllm.stats import EngineStats

logger = logging.getLogger("jaxllm")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        tp: TensorParallelPlan,
        distributed: DistributedSettings,
        cache_dir: str | None,
        startup_info: dict,
        draft: DraftModelProposer | None = None,
    ):
        """The parts come from `from_engine_args` (engine/builder.py); `config` is the resolved one they
        were built with."""
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.tp = tp
        self.distributed = distributed
        self.cache_dir = cache_dir
        self.startup_info = startup_info
        self.max_model_len = config.scheduler.max_model_len
        self.max_kv_tokens = scheduler.max_kv_tokens  # the whole KV cache, in tokens
        # Request sampling defaults (--generation-config), as SamplingParams keyword arguments.
        self.sampling_defaults = dict(config.generation.values)
        self.step_channel = None  # set on process 0 by jaxllm.parallel.follower.lead (several hosts)

        self.output_processor = OutputProcessor(self.tokenizer)
        self._inflight = None  # the dispatched step not yet collected (async scheduling)
        self._unreported_finished: list[str] = []
        self._counter = itertools.count()
        self.last_step_tokens = 0
        self._rng = random.Random(config.model.seed)
        eos = loaded.arch.eos_token_ids or []
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = tok_eos if tok_eos is not None else (eos[0] if eos else None)
        self.extra_eos_ids = [e for e in eos if e != self.eos_token_id]
        # Structured outputs' grammars, compiled before a request is scheduled; the runner takes them from
        # the same cache (None: the model has no tokenizer).
        self.grammars = runner.grammar_compiler
        # Speculative decoding's proposals (--speculative-config; None: off); `draft` runs the draft model.
        self.speculator = Speculator(config.speculative, draft) if config.speculative is not None else None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage: str = "offline") -> LLMEngine:
        """Load, resolve, size, build, compile (engine/builder.py). `usage`: "offline" for LLM(...),
        "server" for the API server (their platform defaults differ: engine/batch_defaults.py)."""
        from jaxllm.engine.builder import build_engine

        return build_engine(args, usage)

    # ---- requests ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        compile_grammar: bool = True,
    ) -> ParentState:
        """Tokenize and validate; raises ValueError naming the field. Mutates no engine state.

        A structured-outputs grammar is compiled here (then cached) unless `compile_grammar` is False: the
        async engine compiles it on an executor thread instead (`compile_grammar`), off the event loop."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, list | tuple):
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.loaded.arch.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.loaded.arch.vocab_size})"
                )
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long; max_model_len={self.max_model_len} leaves no room to "
                "generate (the prompt must be shorter than max_model_len)"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.config.max_logprobs:
                raise ValueError(f"{name}={asked} must be <= max_logprobs={self.config.max_logprobs}")
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + self.extra_eos_ids)
        params = self._check_token_rules(params)
        if params.research is not None:
            self._check_research(params.research)
        if compile_grammar:
            self.compile_grammar(params)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        max_tokens = self._check_kv_fit(len(ids), max_tokens, params.max_tokens is None)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            seed = (params.seed + i) if params.seed is not None else self._rng.getrandbits(62)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=cid,
                prompt_token_ids=list(ids),
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
                sampling_seed=seed,
                max_tokens=max_tokens,
            )
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens
                )
                if params.detokenize and self.tokenizer is not None
                else None
            )
            children.append(ChildState(req, i, detok))
        return ParentState(request_id, text, list(ids), children, RequestMetrics(arrival_time=arrival))

    def _check_kv_fit(self, prompt_len: int, max_tokens: int, default: bool) -> int:
        """max_tokens, refused (ValueError naming max_tokens and the limit) when the prompt and max_tokens
        could never be in the KV cache at once: such a request would wait or be preempted forever. A
        max_tokens left out is cut to what the cache leaves. The check is made here, before the request
        reaches the scheduler, so that it never fails on the engine thread."""
        capacity = self.scheduler.max_kv_tokens
        blocks = f"({capacity // self.scheduler.block_size} blocks of {self.scheduler.block_size})"
        if prompt_len >= capacity:
            raise ValueError(
                f"prompt is {prompt_len} tokens long; the whole KV cache holds {capacity} tokens {blocks} and "
                "must leave room to generate"
            )
        if default:
            max_tokens = min(max_tokens, capacity - prompt_len)
        if prompt_len + max_tokens > capacity:
            raise ValueError(
                f"max_tokens={max_tokens}: the prompt's {prompt_len} tokens + max_tokens need "
                f"{prompt_len + max_tokens} tokens of KV cache; the whole KV cache holds {capacity} {blocks}"
            )
        return max_tokens

    def _check_token_rules(self, params: SamplingParams) -> SamplingParams:
        """Token ids within the vocabulary; bad_words as token ids (vLLM's: the word at the start of the
        output and after a space)."""
        vocab = self.loaded.arch.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}={bad[:5]} holds token ids outside the vocabulary [0, {vocab})")
        if (params.structured_outputs is not None or params.bad_words) and self.tokenizer is None:
            field = "structured_outputs" if params.structured_outputs is not None else "bad_words"
            raise ValueError(f"{field}=... needs the model's tokenizer, and this model has none")
        if params.bad_words:
            words: list[list[int]] = []
            for word in params.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                    if ids and ids not in words:
                        words.append(ids)
            params = params.clone()
            params.bad_words_token_ids = words
        return params

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's structured-outputs grammar; ValueError naming
        structured_outputs if it is not valid. Thread-safe, and llguidance drops the GIL meanwhile."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def enqueue(self, parent: ParentState) -> None:
        if parent.request_id in self.output_processor.parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self.output_processor.add(parent)
        for c in parent.children:
            self.scheduler.add_request(c.request)

    def _check_research(self, research) -> None:
        """Raises ValueError naming the field: a model without research sites, a layer or width that does
        not fit, or research under tensor parallelism or a multi-host step (not built yet)."""
        arch = self.loaded.arch
        if not getattr(self.loaded.module, "supports_research", False):
            raise ValueError(
                f"research: {arch.architecture or 'this model'} has no research sites (Llama family only)"
            )
        if self.tp.mesh is not None or self.step_channel is not None:
            raise ValueError("research: not served under tensor parallelism or across hosts")
        research.check_model(arch.num_layers, arch.hidden_size, arch.num_heads)

    def add_request(self, request_id: str, prompt, params: SamplingParams, *, priority: int = 0) -> None:
        self.enqueue(self.prepare_request(request_id, prompt, params, priority=priority))

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (ids unknown here are ignored); returns each one's last output, as its kind
        asks: finish reason "abort" for the samples still running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        op = self.output_processor
        outs = []
        for rid in ids:
            parent = op.parents.get(rid)
            if parent is None:
                continue
            self.scheduler.abort_requests([c.request.request_id for c in parent.children])
            out = op.make_output(parent)
            if out is not None:
                outs.append(out)
            op.remove(rid)
        return outs

    def next_request_id(self) -> str:
        return str(next(self._counter))

    # ---- the loop ------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of one device step, each built as its request's output_kind asks
        (a FINAL_ONLY request has one, in the step it finishes).

        With async scheduling the step after the one being collected is scheduled and dispatched first,
        so the host's scheduling and input building overlap the device's forward pass."""
        overlap = self.config.scheduler.async_scheduling and self.step_channel is None
        timing, clock = self.runner.timing, time.perf_counter
        if self._inflight is None:
            t0 = clock()
            if self.speculator is not None:  # every result is in: proposals can follow the last tokens
                self.speculator.propose(self.scheduler.running)
            sched_out = self._schedule()
            t1 = clock()
            with self.tp.context():
                self._inflight = self.runner.dispatch(sched_out)
            timing.add("schedule", t1 - t0)
            timing.add("dispatch", clock() - t1)
        current = self._inflight
        self._inflight = None
        if overlap and current.samples and not current.verifies and self._can_overlap():
            t0 = clock()
            nxt = self._schedule()
            t1 = clock()
            timing.add("schedule", t1 - t0)
            if not nxt.is_empty:
                with self.tp.context():
                    self._inflight = self.runner.dispatch(nxt, prev=current)
                timing.add("dispatch", clock() - t1)
            else:
                self._unreported_finished.extend(nxt.finished_request_ids)
        t0, wait0 = clock(), timing.wait_s
        runner_out = self.runner.collect(current)
        outputs = self._process(current.sched, runner_out)
        timing.add("process", clock() - t0 - (timing.wait_s - wait0))
        return outputs

    def _schedule(self):
        sched_out = self.scheduler.schedule()
        if self._unreported_finished:  # finished ids of an empty schedule: the runner still drops them
            sched_out.finished_request_ids = self._unreported_finished + sched_out.finished_request_ids
            self._unreported_finished = []
        self.last_step_tokens = sched_out.num_scheduled_tokens
        now = time.monotonic()
        for new in sched_out.new_requests:  # a request is new to the runner when first scheduled
            pc = self.output_processor.child_to_parent.get(new.req_id)
            if pc is not None and pc[0].metrics.first_scheduled_time is None:
                pc[0].metrics.first_scheduled_time = now
        if self.step_channel is not None:  # several hosts: the others replay the same plain message
            self.step_channel.publish(sched_out)
        return sched_out

    def _can_overlap(self) -> bool:
        """No request needs every earlier token on the host when its next step is built (penalties read
        the whole history; prompt logprobs need all logits of a chunk; speculation's proposals follow the
        last token)."""
        if self.speculator is not None and self.speculator.speculating(self.scheduler.running):
            return False
        for r in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            p = r.sampling_params
            if p.uses_penalties or p.prompt_logprobs is not None:
                return False
        return True

    def _process(self, sched_out, runner_out) -> list[RequestOutput]:
        op = self.output_processor
        for rid, lp in runner_out.prompt_logprobs.items():
            if rid in op.child_to_parent:
                op.on_prompt_logprobs(rid, lp)
        for rid, caps in runner_out.captures.items():
            if rid in op.child_to_parent:
                op.on_captures(rid, caps)
        updated = self.scheduler.update_from_output(sched_out, runner_out)
        # after the update: it drops accepted proposals past a stop from the runner's lists
        new_tokens = {
            rid: toks for rid, toks in zip(runner_out.req_ids, runner_out.sampled_token_ids) if toks
        }
        touched: dict[str, ParentState] = {}
        stopped: list[tuple[Request, str]] = []
        for req in updated:
            pc = op.child_to_parent.get(req.request_id)
            if pc is None:
                continue
            stop = op.on_tokens(
                req, new_tokens.get(req.request_id, []), runner_out.logprobs.get(req.request_id)
            )
            if stop is not None and not req.is_finished:
                stopped.append((req, stop))
            touched[pc[0].request_id] = pc[0]
        for req, stop in stopped:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stop
        outputs = []
        for parent in touched.values():
            out = op.make_output(parent)
            if out is not None:
                outputs.append(out)
            if parent.finished:
                op.remove(parent.request_id)
        return outputs

    def get_stats(self) -> EngineStats:
        """A fresh immutable snapshot of the counters. It reads the scheduler's and the runner's state, so
        call it from the thread that steps the engine (AsyncLLMEngine publishes one after each step)."""
        timing = self.runner.timing
        return dataclasses.replace(
            self.scheduler.get_stats(),
            num_compiling_in_background=self.runner.num_compiling_in_background(),
            num_steps=timing.steps,
            step_device_wait_s=timing.wait_s,
            step_host_s=MappingProxyType(dict(timing.host_s)),
            compilation_cache=MappingProxyType(dataclasses.asdict(compilation_cache.counts())),
        )
