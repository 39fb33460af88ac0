"""LLMEngine: where the host-side core and the device-side runner meet.

    add_request -> tokenize, validate, fan out n child Requests -> Scheduler.add_request
    step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update_from_output()
             -> OutputProcessor (detokenize, stop strings, logprobs) -> list[RequestOutput]

Startup: load the model (or restore converted params), size the KV cache from gpu_memory_utilization,
allocate it, compile every bucket (unless enforce_eager), log what vLLM logs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import time
from types import MappingProxyType

import jax

from jaxllm.config import EngineConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.batch_defaults import default_batch_limits, device_total_memory
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.heap import collect_dropped_engines, freeze_startup_heap
from jaxllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from jaxllm.layers.attention import resolve_backend
from jaxllm.loader import load_model
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.parallel import agree_on_min, initialize_distributed, plan_tensor_parallel
from jaxllm.request import Request, RequestStatus
from jaxllm.runner import executable_cache
from jaxllm.runner.executable_cache import ExecutableCache
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.stats import EngineStats

logger = logging.getLogger("jaxllm")

_CPU_MAX_MODEL_LEN = 2048


def size_device_memory_pool(gpu_memory_utilization: float) -> None:
    """XLA's GPU memory pool takes the fraction vLLM users set (JAX's own default is 75%). Effective only
    before JAX starts its backend, so every entry point calls this first."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{min(gpu_memory_utilization, 0.99):.3f}")


def enable_compilation_cache(path: str | None) -> str | None:
    if path == "":
        return None
    path = path or os.environ.get("JAXLLM_CACHE_DIR") or os.path.expanduser("~/.cache/jaxllm/xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, user_set: frozenset[str] = frozenset(), usage: str = "offline"
    ):
        """`user_set` names the scheduler fields the user gave explicitly; the others get vLLM's defaults for
        the platform and `usage` ("offline" for LLM(...), "server" for the API server; batch_defaults.py)."""
        t_start = time.perf_counter()
        collect_dropped_engines()  # an engine dropped since the last start-up frees its device memory now
        size_device_memory_pool(config.cache.gpu_memory_utilization)
        self.distributed = initialize_distributed(config.parallel)  # before any other jax use
        self.cache_dir = enable_compilation_cache(config.runner.compilation_cache_dir)
        on_host = jax.default_backend() == "cpu"
        backend = resolve_backend(config.runner.attention_backend)
        self.step_channel = None  # set on process 0 by jaxllm.parallel.follower.lead (several hosts)
        self.tp = plan_tensor_parallel(config.parallel.tensor_parallel_size, config.model)
        self.loaded = load_model(
            config.model, attn_backend=backend, sharding_fn=self.tp.sharding_fn, tp_size=self.tp.size
        )
        arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer

        sched = config.scheduler
        max_model_len = config.model.max_model_len or arch.max_position_embeddings
        if on_host and config.model.max_model_len is None:
            max_model_len = min(max_model_len, _CPU_MAX_MODEL_LEN)
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings}"
            )
        device = jax.local_devices()[0]
        default_seqs, default_tokens = default_batch_limits(
            usage,
            jax.default_backend(),
            device_total_memory(device.memory_stats()),
            getattr(device, "device_kind", ""),
        )
        max_num_seqs = sched.max_num_seqs if "max_num_seqs" in user_set else default_seqs
        max_tokens = sched.max_num_batched_tokens if "max_num_batched_tokens" in user_set else default_tokens
        if not sched.enable_chunked_prefill:
            max_tokens = max(max_tokens, max_model_len)
        sched = dataclasses.replace(
            sched, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens
        )
        self.config = dataclasses.replace(config, scheduler=sched)
        self.max_model_len = max_model_len
        cache = config.cache
        param_dtype = jax.tree.leaves(self.loaded.params)[0].dtype
        kv_dtype = param_dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype

        keep = config.runner.executable_cache
        keep = (usage == "server" if keep is None else keep) and executable_cache.supported()
        executables = ExecutableCache(
            os.path.join(self.cache_dir, "executables") if keep and self.cache_dir else None
        )
        self.runner = ModelRunner(
            self.loaded.module,
            self.loaded.params,
            num_layers=arch.num_layers,
            num_kv_heads=self.tp.kv_heads(arch.num_kv_heads),
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            kv_dtype=kv_dtype,
            block_size=cache.block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_tokens,
            bucket_pages=backend == "reference",
            bucket_growth=4 if on_host else 2,
            kv_sharding=self.tp.kv_sharding,
            executable_cache=executables,
        )
        with self.tp.context():
            num_blocks, why = self.runner.determine_num_blocks(
                cache.gpu_memory_utilization, cache.num_gpu_blocks_override, max_num_seqs
            )
        num_blocks = agree_on_min(num_blocks)  # every host allocates the same cache
        num_cpu_blocks = int(cache.swap_space_gib * 2**30) // self.runner.geometry.bytes_per_block
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.scheduler = Scheduler(sched, cache, num_blocks, num_cpu_blocks)
        self.compile_time_s = 0.0
        ahead = config.runner.compile_ahead if config.runner.compile_ahead is not None else not on_host
        if ahead and not config.runner.enforce_eager:
            with self.tp.context():
                self.compile_time_s = self.runner.compile_all()

        kv_gib = num_blocks * self.runner.geometry.bytes_per_block / 2**30
        self.max_concurrency = num_blocks * cache.block_size / max_model_len
        self.startup_info = {
            "model": self.loaded.model_name,
            "dtype": str(param_dtype),
            "kv_cache_dtype": str(kv_dtype),
            "attention_backend": backend,
            "num_gpu_blocks": num_blocks,
            "num_cpu_blocks": num_cpu_blocks,
            "block_size": cache.block_size,
            "kv_cache_gib": round(kv_gib, 3),
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_tokens,
            "max_concurrency": round(self.max_concurrency, 2),
            "load_time_s": round(self.loaded.load_time_s, 2),
            "compile_time_s": round(self.compile_time_s, 2),
            "compiled_variants": self.runner.num_compiled(),
            "startup_time_s": round(time.perf_counter() - t_start, 2),
            "compilation_cache": self.cache_dir,
            "executables_loaded": executables.hits,
        }
        logger.info(
            "model %s (%s, attention %s) loaded in %.2f s",
            self.loaded.model_name,
            self.startup_info["dtype"],
            backend,
            self.loaded.load_time_s,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %.3f GiB (%s)", num_blocks, cache.block_size, kv_gib, why
        )
        logger.info(
            "maximum concurrency for %d tokens per request: %.2fx", max_model_len, self.max_concurrency
        )
        logger.info(
            "compiled %d step variants in %.1f s, %d more compiling in the background (cache: %s%s)",
            self.runner.num_compiled(),
            self.compile_time_s,
            self.runner.num_compiling_in_background(),
            self.cache_dir,
            f"; executables: {executables.hits} loaded, {executables.misses} compiled"
            if executables.directory
            else "",
        )

        self.output_processor = OutputProcessor(self.tokenizer)
        self._inflight = None  # the dispatched step not yet collected (async scheduling)
        self._unreported_finished: list[str] = []
        self._counter = itertools.count()
        self.last_step_tokens = 0
        self._rng = random.Random(config.model.seed)
        eos = arch.eos_token_ids or []
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = tok_eos if tok_eos is not None else (eos[0] if eos else None)
        self.extra_eos_ids = [e for e in eos if e != self.eos_token_id]
        t0 = time.perf_counter()
        self.startup_info["gc_frozen_objects"] = freeze_startup_heap()
        logger.info(
            "froze the start-up heap for the garbage collector: %d objects in %.2f s",
            self.startup_info["gc_frozen_objects"],
            time.perf_counter() - t0,
        )

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
    ) -> ParentState:
        """Tokenize and validate; raises ValueError naming the field. Mutates no engine state."""
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
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + self.extra_eos_ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
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

    def enqueue(self, parent: ParentState) -> None:
        if parent.request_id in self.output_processor.parents:
            raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self.output_processor.add(parent)
        for c in parent.children:
            self.scheduler.add_request(c.request)

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
            sched_out = self._schedule()
            t1 = clock()
            with self.tp.context():
                self._inflight = self.runner.dispatch(sched_out)
            timing.add("schedule", t1 - t0)
            timing.add("dispatch", clock() - t1)
        current = self._inflight
        self._inflight = None
        if overlap and current.sampled is not None and self._can_overlap():
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
        for sr in sched_out.scheduled:
            pc = self.output_processor.child_to_parent.get(sr.request.request_id)
            if pc is not None and pc[0].metrics.first_scheduled_time is None:
                pc[0].metrics.first_scheduled_time = now
        if self.step_channel is not None:
            self.step_channel.publish(sched_out)
        return sched_out

    def _can_overlap(self) -> bool:
        """No request needs every earlier token on the host when its next step is built (penalties read
        the whole history; prompt logprobs need all logits of a chunk)."""
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
        new_tokens = {
            rid: toks for rid, toks in zip(runner_out.req_ids, runner_out.sampled_token_ids) if toks
        }
        updated = self.scheduler.update_from_output(sched_out, runner_out)
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
        )
