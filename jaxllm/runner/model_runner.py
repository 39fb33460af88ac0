"""Runs one scheduled step on the device: inputs -> jitted model step -> jitted sampler -> host output.

    SchedulerOutput --build_step_inputs--> StepInputs (numpy, padded to a bucket, one packed i32 buffer)
      --(one copy, in the executable's call)--> model_step(params, kv_caches [donated], packed) -> logits f32[S, V], kv_caches
      --sample--> ids i32[S] (+ logprobs) --device_get--> ModelRunnerOutput

The model step is dispatched before the sampling metadata is built: JAX runs it asynchronously, so the
host builds the sampler's inputs while the device runs the forward pass.

Every bucket of the model step and the sampler variants every workload uses (greedy and random
sampling, with or without top-k / top-p) are compiled before the engine is ready by `compile_all` unless
`enforce_eager`: all of them at once on a thread pool (XLA compiles, and loads from the persistent
compilation cache, outside the GIL), kept as compiled executables that the step calls directly. The
other sampler variants (penalties, logprobs: 3 in 4 of them) are traced before ready too, and compile
after it on background threads (tracing holds the GIL, which the steps need; XLA's compilation does not);
a step that needs one first waits for its compile instead of compiling it again. The persistent cache
makes a restart cheap. Prompt logprobs use a separate all-rows logits variant, compiled on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.compat import jit_cache_size, register_atexit_before_thread_pools
from jaxllm.layers.attention_metadata import AttentionMetadata
from jaxllm.runner import kv_cache as kvc
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.executable_cache import ExecutableCache, describe_args
from jaxllm.runner.input_batch import StepInputs, build_step_inputs, empty_step_inputs, packed_size, unpack
from jaxllm.runner.sampler import SamplerFlags, compute_prompt_logprobs, sample
from jaxllm.runner.sampling_metadata import SamplingRow, build_sampling_metadata
from jaxllm.runner.xla_options import STEP_TIERS, step_tier, tier_options
from jaxllm.runner_output import ModelRunnerOutput, TokenLogprobs
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("jaxllm")

# Logprobs are computed for this many top tokens whenever any request in the step asks (static shape).
MAX_LOGPROBS = 20


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: its device results (not yet read) and where each request's token sits in them."""

    sched: SchedulerOutput
    out: ModelRunnerOutput
    sampled: object = None  # device SamplerOutput; None when nothing was scheduled
    ids: jax.Array | None = None  # i32[ids_width] sampled ids on the device (the next step's prev_ids)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> row in `ids`


@dataclasses.dataclass
class StepTiming:
    """Where the steps' wall time went: `wait_s` is spent blocked on the device's results (the device
    busy, the host idle). The rest is host work: one step at a time the device waits for all of it; with
    async scheduling it overlaps the device's step in flight."""

    steps: int = 0
    wait_s: float = 0.0
    host_s: dict[str, float] = dataclasses.field(default_factory=dict)  # the engine's phases (stats.py)

    def add(self, phase: str, seconds: float) -> None:
        self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds


class ModelRunner:
    def __init__(
        self,
        module,
        params,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        kv_dtype,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        bucket_pages: bool,
        bucket_growth: int = 2,
        kv_sharding=None,
        executable_cache: ExecutableCache | None = None,
    ):
        self.module = module
        # Executables kept on disk across starts (executable_cache.py); a disabled one compiles every time.
        self.executables = executable_cache or ExecutableCache(None)
        self.params = params
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.geometry = kvc.KVGeometry(num_layers, num_kv_heads, head_dim, block_size, jnp.dtype(kv_dtype))
        self.max_pages_per_seq = -(-max_model_len // block_size)
        self.plan = BucketPlan.build(
            max_num_batched_tokens,
            max_num_seqs,
            self.max_pages_per_seq,
            bucket_pages=bucket_pages,
            growth=bucket_growth,
        )
        self.kv_sharding = kv_sharding
        # Penalty history (prompt + output ids) has one static width, so penalties never add a variant.
        self.history_width = 1 << max(6, (max_model_len - 1).bit_length())
        self.kv_caches: list | None = None
        self.timing = StepTiming()
        self._rows: dict[str, SamplingRow] = {}  # request id -> its sampling row (dropped when finished)
        self.swap: kvc.HostSwapSpace | None = None
        # The model step, one jit per tier of compiler options (xla_options: small buckets merge more dots,
        # large ones run their GEMMs on cuBLAS).
        step_jit = functools.partial(
            jax.jit, self._model_step_impl, donate_argnums=(1,), static_argnames=("shape", "all_logits")
        )
        self._model_steps = {tier: step_jit(compiler_options=tier_options(tier)) for tier in STEP_TIERS}
        # Sampled ids are also returned padded to one width, the next step's `prev_ids` (one shape).
        self.ids_width = max(s for _, s, _ in self.plan.all_shapes())
        self._zero_ids = None
        self._sample = jax.jit(self._sample_impl, static_argnames=("flags",))
        self._prompt_logprobs = jax.jit(compute_prompt_logprobs, static_argnames=("num_logprobs",))
        # Executables compiled ahead by compile_all: bucket shape -> model step (the logits of the sampled
        # rows only); (S, flags) -> sampler.
        self._ahead_model: dict = {}
        self._ahead_sample: dict = {}
        # (S, flags) -> Future of a sampler variant compiling in the background (compile_all)
        self._pending_sample: dict = {}
        self._background: ThreadPoolExecutor | None = None

    # ---- the jitted pieces ---------------------------------------------------------------------------
    def _model_step_impl(
        self, params, kv_caches, packed, prev_ids, *, shape: tuple[int, int, int], all_logits: bool
    ):
        v = unpack(packed, shape)
        src = v["prev_src"]  # async scheduling: inputs the previous step sampled, still on the device
        input_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], v["input_ids"])
        md = AttentionMetadata(
            positions=v["positions"],
            slot_mapping=v["slot_mapping"],
            block_tables=v["block_tables"],
            kv_lens=v["kv_lens"],
            cu_q_lens=v["cu_q_lens"],
            num_seqs=v["num_seqs"],
        )
        hidden, kv_caches = self.module.apply({"params": params}, input_ids, kv_caches, md)
        rows = hidden if all_logits else hidden[v["logits_indices"]]
        logits = self.module.apply({"params": params}, rows, method="compute_logits")
        return logits, kv_caches

    def _sample_impl(self, logits, md, *, flags: SamplerFlags):
        out = sample(logits, md, flags=flags)
        padded = jnp.zeros((self.ids_width,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
        return out, padded

    # ---- memory --------------------------------------------------------------------------------------
    def largest_step_temp_bytes(self) -> int:
        """Bytes a step needs beyond the weights and the KV cache, at the largest bucket."""
        t = self.plan.token_buckets[-1]
        shape = (t, self.plan.seqs_for(t), self.plan.page_buckets[-1])
        sds = jax.ShapeDtypeStruct
        kv = [
            (sds(self.geometry.layer_shape(16), self.geometry.dtype),) * 2
            for _ in range(self.geometry.num_layers)
        ]
        packed = sds((packed_size(*shape),), jnp.int32)
        prev = sds((self.ids_width,), jnp.int32)
        params = jax.tree.map(lambda x: sds(x.shape, x.dtype), self.params)
        compiled = self._compile_model_step(shape, (params, kv, packed, prev))
        model_temp = _memory(compiled, "temp_size_in_bytes")
        # The sampler runs after the forward's temporaries are freed; its widest variant (penalty history,
        # the V-wide sort, logprobs) over the largest bucket's rows can need more (S=1024: several GiB).
        info = compiled.out_info[0]
        sampler = self._compile_sampler(
            sds(info.shape, info.dtype), SamplerFlags(False, True, True, MAX_LOGPROBS)
        )
        sampler_need = _memory(sampler, "temp_size_in_bytes") + _memory(sampler, "argument_size_in_bytes")
        return max(model_temp, sampler_need)

    def determine_num_blocks(self, util: float, override: int | None, max_num_seqs: int) -> tuple[int, str]:
        if override is not None:
            return override, "num_gpu_blocks_override"
        useful = max_num_seqs * self.max_pages_per_seq + 1
        temp = self.largest_step_temp_bytes() if jax.default_backend() != "cpu" else 0
        shards = len(self.kv_sharding.device_set) if self.kv_sharding is not None else 1
        return kvc.num_blocks_for_memory(self.geometry, util, temp, useful, shards)

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = kvc.allocate(self.geometry, num_blocks, self.kv_sharding)
        if num_cpu_blocks > 0:
            self.swap = kvc.HostSwapSpace(self.geometry, num_cpu_blocks)

    # ---- compilation ---------------------------------------------------------------------------------
    def compile_all(self, workers: int | None = None) -> float:
        """Compile every bucket of the model step and every sampler variant, `workers` at a time.

        Tracing holds the GIL, but XLA's compilation (or its load from the persistent cache) does not, so
        the variants compile side by side. Under tensor parallelism (a sharded KV cache) the step's inputs
        would need their shardings spelled out for an executable; there the variants instead run once each
        through jit, one after another, on padding inputs (which write nothing: all slots are -1)."""
        t0 = time.perf_counter()
        if self.kv_sharding is not None:
            self._warm_sequentially()
            return time.perf_counter() - t0
        try:
            self._compile_ahead_parallel(workers or min(32, os.cpu_count() or 4))
        except Exception:  # a variant that truly fails to compile fails again in the warm-up, loudly
            logger.warning(
                "parallel ahead-of-time compilation failed; warming up one variant at a time", exc_info=True
            )
            self._ahead_model, self._ahead_sample = {}, {}
            self._warm_sequentially()
        return time.perf_counter() - t0

    def _compile_ahead_parallel(self, workers: int) -> None:
        sds = jax.ShapeDtypeStruct
        prev = sds((self.ids_width,), jnp.int32)

        def model(shape):
            packed = sds((packed_size(*shape),), jnp.int32)
            return self._compile_model_step(shape, (self.params, self.kv_caches, packed, prev))

        later = {}  # (S, flags) -> the logits the variant takes, compiled after ready
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-compile") as pool:
            models = {shape: pool.submit(model, shape) for shape in self.plan.all_shapes()}
            samplers = {}
            for shape, fut in models.items():
                info = fut.result().out_info[0]  # the logits the sampler of this bucket takes
                logits = sds(info.shape, info.dtype)
                for flags in SamplerFlags.all_variants(MAX_LOGPROBS):
                    key = (shape[1], flags)
                    if key in samplers or key in later:
                        continue
                    if flags.needed_at_start:
                        samplers[key] = pool.submit(self._compile_sampler, logits, flags)
                    else:
                        later[key] = logits
            # The later variants are traced here, before ready, while the pool compiles the common ones:
            # tracing holds the GIL, and on background threads it took it from the first steps (a 4 ms loop
            # beside 4 threads on the development CPU: p99 24 ms, 9 ms when they only compile). XLA's
            # compilation, left to the background, does not hold it; nor does loading a stored executable,
            # so variants the executable cache holds are not traced at all.
            todo = {}
            for key, logits in later.items():
                desc = self._sampler_description(logits, key[1])
                if self.executables.contains(desc):  # loaded (traced there only if the entry fails to load)
                    todo[key] = functools.partial(self._compile_sampler, logits, key[1])
                else:
                    lowered = self._lower_sampler(logits, key[1])
                    todo[key] = functools.partial(
                        self.executables.get_or_compile, desc,
                        functools.partial(self._compile_lowered, lowered, key[1]),
                    )  # fmt: skip
            self._ahead_model = {shape: f.result() for shape, f in models.items()}
            self._ahead_sample = {key: f.result() for key, f in samplers.items()}
        self._compile_in_background(todo, max(1, min(4, workers // 2)))

    def _compile_in_background(self, todo: dict, workers: int) -> None:
        """Compile the sampler variants `todo` ((S, flags) -> a call that returns the executable: compiles
        a traced variant or loads a stored one) on background threads. Each goes into _ahead_sample when
        done; _sample_step waits on one still compiling. At interpreter exit the
        queued variants are cancelled and the workers finish only the one in hand (a short script does
        not wait for them: concurrent.futures alone would run the whole queue before exiting)."""
        if not todo:
            return
        t0 = time.perf_counter()
        self._background = ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-compile-later")
        # Runs before concurrent.futures' own exit hook (these hooks run last-registered first).
        register_atexit_before_thread_pools(
            functools.partial(self._background.shutdown, wait=False, cancel_futures=True)
        )
        left = [len(todo)]

        def done(key, fut):
            if not fut.cancelled() and fut.exception() is None:  # a failed one compiles through jit
                self._ahead_sample[key] = fut.result()
            self._pending_sample.pop(key, None)
            left[0] -= 1
            if left[0] == 0:
                logger.info(
                    "compiled %d more sampler variants (penalties, logprobs) in the background in %.1f s",
                    len(todo), time.perf_counter() - t0,
                )  # fmt: skip

        for key, build in todo.items():
            fut = self._background.submit(build)
            self._pending_sample[key] = fut
            fut.add_done_callback(lambda f, key=key: done(key, f))
        self._background.shutdown(wait=False)  # takes no more work; the queued variants still compile

    def wait_for_background_compiles(self) -> None:
        """Block until every sampler variant compile_all left to the background is compiled."""
        for fut in list(self._pending_sample.values()):
            if not fut.cancelled():
                fut.exception()  # waits; a failure is left to jit at first use

    def _compile_model_step(self, shape, args):
        """The model step of bucket `shape` for these (abstract) arguments, compiled or loaded from the
        executable cache."""
        tier = step_tier(shape[0])
        desc = (
            f"model_step shape={shape} all_logits=False tier={tier} options={tier_options(tier)} "
            f"module={self.module!r} args={describe_args(args)}"
        )
        compile_fn = lambda: self._step_jit(shape).lower(*args, shape=shape, all_logits=False).compile()  # noqa: E731
        return self.executables.get_or_compile(desc, compile_fn)

    def _sampler_description(self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags) -> str:
        smd = self._empty_sampling_metadata(logits.shape[0], flags)
        return f"sampler flags={flags} ids_width={self.ids_width} args={describe_args((logits, smd))}"

    def _compile_sampler(self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags):
        """The sampler variant `flags` for logits of this shape, compiled ahead (or loaded)."""
        return self.executables.get_or_compile(
            self._sampler_description(logits, flags),
            lambda: self._compile_lowered(self._lower_sampler(logits, flags), flags),
        )

    def _lower_sampler(self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags):
        """The sampler variant `flags` traced and lowered for logits of this shape (Python: holds the GIL)."""
        smd = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
            self._empty_sampling_metadata(logits.shape[0], flags),
        )
        return self._sample.lower(logits, smd, flags=flags)

    @staticmethod
    def _compile_lowered(lowered, flags: SamplerFlags):
        """XLA's compilation of a lowered sampler variant (or its load from the persistent cache); `flags`
        names the variant."""
        return lowered.compile()

    def _warm_sequentially(self) -> None:
        for t, s, b in self.plan.all_shapes():
            logits = self._run_model(empty_step_inputs((t, s, b)), all_logits=False)
            for flags in SamplerFlags.all_variants(MAX_LOGPROBS):
                out = self._sample_step(
                    logits, jax.device_put(self._empty_sampling_metadata(s, flags)), flags
                )
        jax.block_until_ready(out)

    def _empty_sampling_metadata(self, s: int, flags: SamplerFlags):
        """Sampler inputs of a bucket with no rows: what compiling a sampler variant ahead needs."""
        return build_sampling_metadata([], s, self.vocab_size, history_width=self.history_width, flags=flags)

    # ---- one step ------------------------------------------------------------------------------------
    def _run_model(self, inputs: StepInputs, *, all_logits: bool, prev_ids=None):
        if prev_ids is None:
            if self._zero_ids is None:
                self._zero_ids = jnp.zeros((self.ids_width,), jnp.int32)
            prev_ids = self._zero_ids
        # Host arrays go to the executable as they are: its C++ call path copies them to the device in
        # microseconds, where jax.device_put's Python path took 0.08 ms per array (0.45 ms for the
        # sampler's 13) on the development CPU, on the host's critical path of every step.
        args = (self.params, self.kv_caches, inputs.packed, prev_ids)
        ahead = None if all_logits else self._ahead_model.get(inputs.shape)
        if ahead is not None:
            logits, self.kv_caches = ahead(*args)
        else:
            step = self._step_jit(inputs.shape)
            logits, self.kv_caches = step(*args, shape=inputs.shape, all_logits=all_logits)
        return logits

    def _step_jit(self, shape):
        """The jitted model step whose compiler options suit the bucket (xla_options)."""
        return self._model_steps[step_tier(shape[0])]

    def _sample_step(self, logits, smd, flags: SamplerFlags):
        key = (logits.shape[0], flags)
        ahead = self._ahead_sample.get(key)
        if ahead is None and (pending := self._pending_sample.get(key)) is not None:
            if not pending.cancelled() and pending.exception() is None:  # compiling: wait for it
                ahead = pending.result()
        return ahead(logits, smd) if ahead is not None else self._sample(logits, smd, flags=flags)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.dispatch(sched))

    def dispatch(self, sched: SchedulerOutput, prev: InFlightStep | None = None) -> InFlightStep:
        """Start the step on the device and return without waiting for it. `prev` (async scheduling): the
        step still in flight, whose sampled ids feed this step's decode rows that need them."""
        if self.swap is not None:
            self.swap.swap_out(self.kv_caches, sched.blocks_to_swap_out)
            self.kv_caches = self.swap.swap_in(self.kv_caches, sched.blocks_to_swap_in)
        out = ModelRunnerOutput(req_ids=[sr.request.request_id for sr in sched.scheduled])
        if not sched.scheduled:
            return InFlightStep(sched, out)
        inputs = build_step_inputs(sched, self.plan, self.block_size, prev.rows if prev is not None else None)
        want_prompt_lp = [sr for sr in sched.scheduled if _wants_prompt_logprobs(sr)]
        logits = self._run_model(
            inputs, all_logits=bool(want_prompt_lp), prev_ids=prev.ids if prev is not None else None
        )
        if want_prompt_lp:
            all_logits = logits
            logits = all_logits[jnp.asarray(inputs.logits_indices)]
            self._collect_prompt_logprobs(sched, inputs, all_logits, out)

        # The forward pass is in flight: build the sampler's inputs meanwhile.
        s = inputs.shape[1]
        for rid in sched.finished_request_ids:
            self._rows.pop(rid, None)
        rows = [self._sampling_row(sr) if sr.samples else None for sr in sched.scheduled]
        # Tokens of each row still in flight before the one drawn now (its own placeholder excluded).
        pending = [
            max(0, sr.request.num_output_placeholders - 1) if sr.samples else 0 for sr in sched.scheduled
        ]
        flags = SamplerFlags.for_rows(rows, MAX_LOGPROBS, self.vocab_size)
        if flags.do_penalties and any(pending):
            raise ValueError(
                "penalties need every earlier token on the host: schedule such steps synchronously"
            )
        smd = build_sampling_metadata(
            rows, s, self.vocab_size, history_width=self.history_width, flags=flags, pending=pending
        )
        sampled, ids = self._sample_step(logits, smd, flags)  # numpy leaves: see _run_model
        rows_of = {sr.request.request_id: i for i, sr in enumerate(sched.scheduled) if sr.samples}
        return InFlightStep(sched, out, sampled, ids, rows_of)

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a dispatched step and read its sampled tokens (and logprobs) back to the host."""
        out, sched = step.out, step.sched
        if step.sampled is None:
            return out
        t_wait = time.perf_counter()
        result = jax.device_get(step.sampled)
        self.timing.steps += 1
        self.timing.wait_s += time.perf_counter() - t_wait
        ids = np.asarray(result.token_ids)
        for i, sr in enumerate(sched.scheduled):
            if not sr.samples:
                out.sampled_token_ids.append([])
                continue
            out.sampled_token_ids.append([int(ids[i])])
            if sr.request.sampling_params.logprobs is not None and result.logprob_ids is not None:
                n = sr.request.sampling_params.logprobs
                out.logprobs[sr.request.request_id] = TokenLogprobs(
                    token_ids=np.asarray(result.logprob_ids[i : i + 1, : n + 1]),
                    logprobs=np.asarray(result.logprobs[i : i + 1, : n + 1]),
                    ranks=np.asarray(result.ranks[i : i + 1, : n + 1]),
                )
        return out

    def _collect_prompt_logprobs(self, sched, inputs: StepInputs, all_logits, out: ModelRunnerOutput) -> None:
        """Logprob of each prompt token given its prefix, for the positions this chunk computed."""
        t = inputs.shape[0]
        next_ids = np.zeros(t, np.int32)
        for i, sr in enumerate(sched.scheduled):
            req = sr.request
            a = int(inputs.cu_q_lens[i])
            for j in range(sr.num_new_tokens):
                p = sr.start + j + 1
                if p < req.num_prompt_tokens:
                    next_ids[a + j] = req.prompt_token_ids[p]
        ids, lps, ranks = jax.device_get(
            self._prompt_logprobs(all_logits, jnp.asarray(next_ids), num_logprobs=MAX_LOGPROBS)
        )
        for i, sr in enumerate(sched.scheduled):
            if not _wants_prompt_logprobs(sr):
                continue
            req = sr.request
            n = req.sampling_params.prompt_logprobs
            a = int(inputs.cu_q_lens[i])
            m = max(0, min(sr.num_new_tokens, req.num_prompt_tokens - 1 - sr.start))
            out.prompt_logprobs[req.request_id] = TokenLogprobs(
                token_ids=np.asarray(ids[a : a + m, : n + 1]),
                logprobs=np.asarray(lps[a : a + m, : n + 1]),
                ranks=np.asarray(ranks[a : a + m, : n + 1]),
            )

    def _sampling_row(self, sr: ScheduledRequest) -> SamplingRow:
        """One SamplingRow per request, kept until it finishes (it holds the request's live token lists)."""
        r = sr.request
        row = self._rows.get(r.request_id)
        if row is None or row.output_token_ids is not r.output_token_ids:
            row = self._rows[r.request_id] = SamplingRow.from_request(r)
        return row

    def num_compiling_in_background(self) -> int:
        return len(self._pending_sample)

    def num_compiled(self) -> int:
        jitted = sum(jit_cache_size(f) for f in (self._sample, self._prompt_logprobs))
        return jitted + self.model_step_traces() + len(self._ahead_model) + len(self._ahead_sample)

    def model_step_traces(self) -> int:
        """Model-step variants jit compiled on the way (not ahead of time)."""
        return sum(jit_cache_size(step) for step in self._model_steps.values())


def _wants_prompt_logprobs(sr: ScheduledRequest) -> bool:
    return sr.request.sampling_params.prompt_logprobs is not None and sr.start < sr.request.num_prompt_tokens


def _memory(compiled, field: str) -> int:
    mem = compiled.memory_analysis()
    return int(getattr(mem, field, 0) or 0) if mem is not None else 0
