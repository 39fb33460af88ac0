"""Compiling the runner's step ahead: every bucket of the model step and every sampler variant.

    StepCompiler(model_step_fn, sample_fn, ...) -> jitted model step (one jit per tier of XLA options),
                                                   jitted sampler, jitted prompt logprobs
    compile_all -> ahead_model[shape], ahead_sample[(S, flags)]: executables the step calls directly
                -> pending_sample[(S, flags)]: variants still compiling on background threads

Every bucket of the model step and the sampler variants every workload uses (greedy and random sampling,
with or without top-k / top-p) are compiled before the engine is ready, all of them at once on a thread
pool: XLA compiles (and loads from the persistent compilation cache) outside the GIL. The other sampler
variants (penalties, logprobs, token masks: 11 in 15 of them) are traced before ready too, and compile after it on
background threads (tracing holds the GIL, which the steps need; XLA's compilation does not); a step
that needs one first waits for its compile instead of compiling it again. Executables also go through
the executable cache (executable_cache.py), so a warm start loads them without tracing. Prompt logprobs
use a separate all-rows logits variant, compiled through jit on first use.

With speculative decoding (`compile_verification_ahead`), steps that verify proposals need the logits of
every row and a sampler over all of them: each bucket up to the largest such step gets its all-rows model
step and the sampler variants needed at start over its T rows, compiled before ready as well.

With research compiled ahead (`compile_research_later`, the server's --enable-research-api), each bucket's
model step is also traced before ready with the smallest research inputs (runner/research_batch.py's
floors: the captures and edits of a batch of decoding requests), and again capturing every row of the
bucket (a prompt chunk that captures its positions), each at residual sites only and at every site
(models/research_hooks.py), and compiled in the background like the later
sampler variants; steps whose research needs more slots compile theirs through jit on first use.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from jaxllm.compat import jit_cache_size, register_atexit_before_thread_pools
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.executable_cache import ExecutableCache, describe_args
from jaxllm.runner.input_batch import packed_size
from jaxllm.runner.kv_cache import KVGeometry
from jaxllm.runner.research_batch import research_dims
from jaxllm.runner.sampler import compute_prompt_logprobs, sample
from jaxllm.runner.sampling_metadata import MAX_LOGPROBS, SamplerFlags, build_sampling_metadata
from jaxllm.runner.xla_options import STEP_TIERS, step_tier, tier_options

logger = logging.getLogger("jaxllm")


class StepCompiler:
    """The jitted pieces of one runner's step and the executables compiled from them ahead.

    `model_step_fn(params, kv_caches, packed, prev_ids, *, shape, all_logits) -> (logits, kv_caches)` and
    `sample_fn(logits, sampling_metadata, *, flags) -> (SamplerOutput, padded ids)` are the runner's."""

    def __init__(
        self,
        model_step_fn: Callable,
        sample_fn: Callable,
        *,
        plan: BucketPlan,
        module,
        vocab_size: int,
        history_width: int,
        ids_width: int,
        executables: ExecutableCache,
    ):
        self.plan = plan
        self.module = module  # its repr (the model's configuration) goes into executable descriptions
        self.vocab_size = vocab_size
        self.history_width = history_width
        self.ids_width = ids_width
        self.executables = executables
        # One jit of the model step per tier of compiler options (xla_options: small buckets merge more
        # dots, large ones run their GEMMs on cuBLAS); the KV caches (argument 1) are donated.
        step_jit = functools.partial(
            jax.jit,
            model_step_fn,
            donate_argnums=(1,),
            static_argnames=("shape", "all_logits", "research_logits"),
        )
        self.model_steps = {tier: step_jit(compiler_options=tier_options(tier)) for tier in STEP_TIERS}
        self.sample_jit = jax.jit(sample_fn, static_argnames=("flags",))
        self.prompt_logprobs = jax.jit(compute_prompt_logprobs, static_argnames=("num_logprobs",))

        # The sampler over every row of a step (speculative decoding's verification): no padded ids. Its own
        # function, so that jit's cache counts this runner's variants only (num_compiled).
        def sample_rows(logits, md, *, flags):
            return sample(logits, md, flags=flags)

        self.sample_rows_jit = jax.jit(sample_rows, static_argnames=("flags",))
        self.ahead_all_logits: dict = {}  # bucket shape -> model step executable (logits of every row)
        self.ahead_sample_rows: dict = {}  # (T, flags) -> sample_rows executable
        self.ahead_model: dict = {}  # bucket shape -> model step executable (logits of the sampled rows)
        self.ahead_sample: dict = {}  # (S, flags) -> sampler executable
        self.pending_sample: dict = {}  # (S, flags) -> Future of a variant compiling in the background
        self.ahead_research: dict = {}  # (bucket shape, research dims) -> model step executable with research
        self.pending_research: dict = {}  # the same keys -> Future of one compiling in the background
        self.background: ThreadPoolExecutor | None = None

    def step_jit(self, shape):
        """The jitted model step whose compiler options suit the bucket (xla_options)."""
        return self.model_steps[step_tier(shape[0])]

    def sample(self, logits, smd, flags: SamplerFlags):
        """Run the sampler variant `flags`: its executable (waited for while it compiles), else jit."""
        ahead = _ready_or_waited(self.ahead_sample, self.pending_sample, (logits.shape[0], flags))
        return ahead(logits, smd) if ahead is not None else self.sample_jit(logits, smd, flags=flags)

    def sample_rows(self, logits, smd, flags: SamplerFlags):
        """The sampler over every row of `logits` (f32[T, V]) -> SamplerOutput (token_ids i32[T])."""
        ahead = self.ahead_sample_rows.get((logits.shape[0], flags))
        return ahead(logits, smd) if ahead is not None else self.sample_rows_jit(logits, smd, flags=flags)

    def research_step(self, shape, dims: tuple[int, ...], research_logits: bool):
        """The model step with research of these slot sizes, compiled ahead (waited for while it compiles),
        or None: the caller runs it through jit."""
        if research_logits:  # captured logits are rare: their variants always go through jit
            return None
        return _ready_or_waited(self.ahead_research, self.pending_research, (shape, dims))

    def empty_sampling_metadata(self, s: int, flags: SamplerFlags):
        """Sampler inputs of a bucket with no rows: what compiling a sampler variant ahead needs."""
        return build_sampling_metadata([], s, self.vocab_size, history_width=self.history_width, flags=flags)

    # ---- memory --------------------------------------------------------------------------------------
    def largest_step_temp_bytes(self, params, geometry: KVGeometry) -> int:
        """Bytes a step needs beyond the weights and the KV cache, at the largest bucket."""
        t = self.plan.token_buckets[-1]
        shape = (t, self.plan.seqs_for(t), self.plan.page_buckets[-1])
        sds = jax.ShapeDtypeStruct
        kv = [(sds(geometry.layer_shape(16), geometry.dtype),) * 2 for _ in range(geometry.num_layers)]
        packed = sds((packed_size(*shape),), jnp.int32)
        prev = sds((self.ids_width,), jnp.int32)
        abstract = jax.tree.map(lambda x: sds(x.shape, x.dtype), params)
        compiled = self._compile_model_step(shape, (abstract, kv, packed, prev))
        model_temp = _memory(compiled, "temp_size_in_bytes")
        # The sampler runs after the forward's temporaries are freed; its widest variant (penalty history,
        # the V-wide sort, logprobs) over the largest bucket's rows can need more (S=1024: several GiB).
        info = compiled.out_info[0]
        sampler = self._compile_sampler(
            sds(info.shape, info.dtype), SamplerFlags(False, True, True, MAX_LOGPROBS)
        )
        sampler_need = _memory(sampler, "temp_size_in_bytes") + _memory(sampler, "argument_size_in_bytes")
        return max(model_temp, sampler_need)

    # ---- compiling ahead -----------------------------------------------------------------------------
    def compile_all(
        self, params, kv_caches, *, warm: Callable[[], None], sharded: bool, workers=None
    ) -> float:
        """Compile every bucket of the model step and every sampler variant, `workers` at a time; seconds.

        Under tensor parallelism (`sharded`: a sharded KV cache) the step's inputs would need their
        shardings spelled out for an executable; there `warm` instead runs each variant once through jit,
        one after another, on padding inputs (which write nothing: all slots are -1)."""
        t0 = time.perf_counter()
        if sharded:
            warm()
            return time.perf_counter() - t0
        try:
            self._compile_ahead_parallel(params, kv_caches, workers or min(32, os.cpu_count() or 4))
        except Exception:  # a variant that truly fails to compile fails again in the warm-up, loudly
            logger.warning(
                "parallel ahead-of-time compilation failed; warming up one variant at a time", exc_info=True
            )
            self.ahead_model, self.ahead_sample = {}, {}
            warm()
        return time.perf_counter() - t0

    def _compile_ahead_parallel(self, params, kv_caches, workers: int) -> None:
        sds = jax.ShapeDtypeStruct
        prev = sds((self.ids_width,), jnp.int32)

        def model(shape):
            packed = sds((packed_size(*shape),), jnp.int32)
            return self._compile_model_step(shape, (params, kv_caches, packed, prev))

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
            self.ahead_model = {shape: f.result() for shape, f in models.items()}
            self.ahead_sample = {key: f.result() for key, f in samplers.items()}
        self._compile_in_background(todo, max(1, min(4, workers // 2)))

    def compile_verification_ahead(
        self, params, kv_caches, max_tokens: int, workers: int | None = None
    ) -> float:
        """The all-rows model step of every bucket of at most `max_tokens` tokens (rounded up to a bucket)
        and the sampler variants needed at start over its rows: what steps that verify proposals run.
        Seconds taken."""
        t0 = time.perf_counter()
        top = next((t for t in self.plan.token_buckets if t >= max_tokens), self.plan.token_buckets[-1])
        shapes = [shape for shape in self.plan.all_shapes() if shape[0] <= top]
        sds = jax.ShapeDtypeStruct
        prev = sds((self.ids_width,), jnp.int32)
        flags_at_start = [f for f in SamplerFlags.all_variants(MAX_LOGPROBS) if f.needed_at_start]

        def model(shape):
            packed = sds((packed_size(*shape),), jnp.int32)
            return self._compile_model_step(shape, (params, kv_caches, packed, prev), all_logits=True)

        with ThreadPoolExecutor(
            workers or min(32, os.cpu_count() or 4), thread_name_prefix="jaxllm-compile"
        ) as pool:
            models = {shape: pool.submit(model, shape) for shape in shapes}
            samplers = {}
            for shape, fut in models.items():
                info = fut.result().out_info[0]  # f32[T, V]
                for flags in flags_at_start:
                    key = (shape[0], flags)
                    if key not in samplers:
                        samplers[key] = pool.submit(
                            self._compile_sampler, sds(info.shape, info.dtype), flags, True
                        )
            self.ahead_all_logits.update({shape: f.result() for shape, f in models.items()})
            self.ahead_sample_rows.update({key: f.result() for key, f in samplers.items()})
        return time.perf_counter() - t0

    def compile_research_later(
        self, params, kv_caches, research_inputs: Callable[[int, bool, bool], object]
    ) -> None:
        """Trace each bucket's model steps with research (`research_inputs(T, all_rows, residual_only)`:
        the smallest ResearchInputs of a T-token step, capturing up to 32 rows or all T, at residual sites
        only or at every site) now, and compile them on background threads (research_step waits for one
        still compiling), the residual variants first. Steps with research then compile nothing while their
        slots fit those floors."""
        todo = {}
        variants = []
        for residual_only in (True, False):
            for shape in self.plan.all_shapes():
                variants.append((shape, research_inputs(shape[0], False, residual_only)))
                every_row = research_inputs(shape[0], True, residual_only)
                if research_dims(every_row) != research_dims(variants[-1][1]):  # T above the 32-row floor
                    variants.append((shape, every_row))
        for shape, inputs in variants:
            args = self._research_step_args(params, kv_caches, shape, inputs)
            tier = step_tier(shape[0])
            desc = (
                f"model_step shape={shape} all_logits=False research_logits=False tier={tier} "
                f"options={tier_options(tier)} module={self.module!r} args={describe_args(args)}"
            )
            lower = functools.partial(self.lower_research_step, params, kv_caches, shape, inputs)
            if not self.executables.contains(desc):  # traced here, before ready (tracing holds the GIL)
                lower = functools.partial(lambda lowered: lowered, lower())
            todo[(shape, research_dims(inputs))] = functools.partial(
                self.executables.get_or_compile, desc, lambda lower=lower: lower().compile()
            )
        # As many workers as the later sampler variants get (at least two): each compile is one thread of
        # XLA, and the research variants are the most numerous (two site sets per bucket and row size).
        workers = max(2, min(4, (os.cpu_count() or 4) // 2))
        self._compile_in_background(
            todo, workers, self.ahead_research, self.pending_research, "model-step variants with research"
        )

    def _research_step_args(self, params, kv_caches, shape, inputs) -> tuple:
        """The abstract arguments of bucket `shape`'s model step with research `inputs` (their shapes)."""
        sds = jax.ShapeDtypeStruct
        ri = jax.tree.map(lambda x: sds(x.shape, x.dtype), inputs)
        return (
            params,
            kv_caches,
            sds((packed_size(*shape),), jnp.int32),
            sds((self.ids_width,), jnp.int32),
            ri,
        )

    def lower_research_step(self, params, kv_caches, shape, inputs):
        """Bucket `shape`'s model step with research inputs of `inputs`' shapes (a PackedResearch), traced
        and lowered: what compile_research_later compiles for each bucket."""
        args = self._research_step_args(params, kv_caches, shape, inputs)
        return self.step_jit(shape).lower(*args, shape=shape, all_logits=False, research_logits=False)

    def _compile_in_background(
        self, todo: dict, workers: int, into: dict | None = None, pending: dict | None = None, what: str = ""
    ) -> None:
        """Compile the variants `todo` (key -> a call that returns the executable: compiles a traced
        variant or loads a stored one) on background threads. Each goes into `into` (default: the sampler
        variants, ahead_sample) when done; until then its Future sits in `pending`, which `sample` and
        `research_step` wait on. At interpreter exit the queued variants are cancelled and the workers
        finish only the one in hand (a short script does not wait for them: concurrent.futures alone would
        run the whole queue before exiting)."""
        if not todo:
            return
        into = self.ahead_sample if into is None else into
        pending = self.pending_sample if pending is None else pending
        what = what or "sampler variants (penalties, logprobs)"
        t0 = time.perf_counter()
        pool = self.background = ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-compile-later")
        # Runs before concurrent.futures' own exit hook (these hooks run last-registered first).
        register_atexit_before_thread_pools(functools.partial(pool.shutdown, wait=False, cancel_futures=True))
        left = [len(todo)]

        def done(key, fut):
            if not fut.cancelled() and fut.exception() is None:  # a failed one compiles through jit
                into[key] = fut.result()
            pending.pop(key, None)
            left[0] -= 1
            if left[0] == 0:
                logger.info(
                    "compiled %d more %s in the background in %.1f s",
                    len(todo),
                    what,
                    time.perf_counter() - t0,
                )

        for key, build in todo.items():
            fut = pool.submit(build)
            pending[key] = fut
            fut.add_done_callback(lambda f, key=key: done(key, f))
        pool.shutdown(wait=False)  # takes no more work; the queued variants still compile

    def wait_for_background_compiles(self) -> None:
        """Block until every variant left to the background (sampler, research) is compiled."""
        for fut in [*self.pending_sample.values(), *self.pending_research.values()]:
            if not fut.cancelled():
                fut.exception()  # waits; a failure is left to jit at first use

    def _compile_model_step(self, shape, args, all_logits: bool = False):
        """The model step of bucket `shape` for these (abstract) arguments, compiled or loaded from the
        executable cache."""
        tier = step_tier(shape[0])
        desc = (
            f"model_step shape={shape} all_logits={all_logits} tier={tier} options={tier_options(tier)} "
            f"module={self.module!r} args={describe_args(args)}"
        )
        compile_fn = lambda: self.step_jit(shape).lower(*args, shape=shape, all_logits=all_logits).compile()  # noqa: E731
        return self.executables.get_or_compile(desc, compile_fn)

    def _sampler_description(
        self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags, all_rows: bool = False
    ) -> str:
        smd = self.empty_sampling_metadata(logits.shape[0], flags)
        if all_rows:
            return f"sample_rows flags={flags} args={describe_args((logits, smd))}"
        return f"sampler flags={flags} ids_width={self.ids_width} args={describe_args((logits, smd))}"

    def _compile_sampler(self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags, all_rows: bool = False):
        """The sampler variant `flags` for logits of this shape, compiled ahead (or loaded); `all_rows`:
        sample_rows (verification steps), else the runner's sampler."""
        return self.executables.get_or_compile(
            self._sampler_description(logits, flags, all_rows),
            lambda: self._compile_lowered(self._lower_sampler(logits, flags, all_rows), flags),
        )

    def _lower_sampler(self, logits: jax.ShapeDtypeStruct, flags: SamplerFlags, all_rows: bool = False):
        """The sampler variant `flags` traced and lowered for logits of this shape (Python: holds the GIL)."""
        smd = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
            self.empty_sampling_metadata(logits.shape[0], flags),
        )
        jitted = self.sample_rows_jit if all_rows else self.sample_jit
        return jitted.lower(logits, smd, flags=flags)

    @staticmethod
    def _compile_lowered(lowered, flags: SamplerFlags):
        """XLA's compilation of a lowered sampler variant (or its load from the persistent cache); `flags`
        names the variant."""
        return lowered.compile()

    # ---- counts --------------------------------------------------------------------------------------
    def num_compiling_in_background(self) -> int:
        return len(self.pending_sample) + len(self.pending_research)

    def num_compiled(self) -> int:
        jitted = sum(jit_cache_size(f) for f in (self.sample_jit, self.prompt_logprobs, self.sample_rows_jit))
        ahead = (
            len(self.ahead_model) + len(self.ahead_sample) + len(self.ahead_research)
            + len(self.ahead_all_logits) + len(self.ahead_sample_rows)
        )  # fmt: skip
        return jitted + self.model_step_traces() + ahead

    def model_step_traces(self) -> int:
        """Model-step variants jit compiled on the way (not ahead of time)."""
        return sum(jit_cache_size(step) for step in self.model_steps.values())


def _ready_or_waited(ahead: dict, pending: dict, key):
    """The executable of `key` compiled ahead, waiting for it while it compiles; None if there is none (or
    its compilation failed: jit then compiles it)."""
    found = ahead.get(key)
    if found is None and (fut := pending.get(key)) is not None:
        if not fut.cancelled() and fut.exception() is None:  # compiling: wait for it
            found = fut.result()
    return found


def _memory(compiled, field: str) -> int:
    mem = compiled.memory_analysis()
    return int(getattr(mem, field, 0) or 0) if mem is not None else 0
