"""Runs one scheduled step on the device: inputs -> jitted model step -> jitted sampler -> host output.

    SchedulerOutput --RequestStates.update--> the runner's state of each scheduled request
      --build_step_inputs--> StepInputs (numpy, padded to a bucket, one packed i32 buffer)
      --(one copy, in the executable's call)--> model_step(params, kv_caches [donated], packed)
      -> logits f32[S, V], kv_caches --sample--> ids i32[S] (+ logprobs)
      --device_get--> ModelRunnerOutput; the ids are appended to the states

The runner reads only the plain SchedulerOutput and its own per-request state, never the scheduler's
`Request`s, so a follower host that replays the same messages builds the same state.

`dispatch` starts a step and returns without waiting; `collect` waits for it and reads its results back.
The model step is dispatched before the sampling metadata is built: JAX runs it asynchronously, so the
host builds the sampler's inputs while the device runs the forward pass. With async scheduling the
engine dispatches step N+1 before collecting N; N+1's decode rows whose input N is still sampling take
it from N's sampled ids on the device (`prev_src`).

Rows with token rules (structured outputs, allowed_token_ids, logit_bias, bad words) get their bitmask
filled while the forward pass runs too. Under async scheduling a grammar must first consume the token the
previous step is still drawing for its row, so the mask waits for that step to finish: a token-rules
thread reads the token back, fills the masks and enqueues the sampler, while the step thread collects the
previous step and schedules the next (filling the masks in line kept the step thread from both, one
fill per step on the engine's critical path). The next dispatch waits for that thread first.

Speculative decoding: a step whose scheduled requests carry proposed tokens (ScheduledRequest.
spec_token_ids) computes the logits of every row and samples at each of a request's last k + 1 rows, the
j-th with the key of its token number len(output) + j; collect keeps the samples up to the first that
differs from its proposal (jaxllm/spec_decode/verify.py). Such a step is never dispatched behind one in
flight: its proposals were made from that step's tokens.

Which executable runs each bucket and sampler variant, and compiling them ahead, is compiler.py's.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import AttentionMetadata
from jaxllm.parallel.mesh import mesh_context
from jaxllm.runner import kv_cache as kvc
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.compiler import StepCompiler
from jaxllm.runner.executable_cache import ExecutableCache
from jaxllm.runner.input_batch import StepInputs, build_step_inputs, empty_step_inputs, unpack
from jaxllm.runner.request_state import RequestState, RequestStates
from jaxllm.runner.research_batch import (
    PackedResearch,
    ResearchBatch,
    build_research_batch,
    pack_research,
    research_dims,
    smallest_research_inputs,
)
from jaxllm.runner.sampler import SamplerFlags, sample
from jaxllm.runner.sampling_metadata import (
    MAX_LOGPROBS,
    apply_token_rules,
    build_sampling_metadata,
    token_rules_rows,
)
from jaxllm.runner_output import ModelRunnerOutput, TokenLogprobs
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxllm.spec_decode.verify import accepted_tokens
from jaxllm.structured_output.token_constraint import TokenConstraint

__all__ = ["MAX_LOGPROBS", "InFlightStep", "ModelRunner", "StepTiming"]


def _captured_rows(research: ResearchBatch, captures: tuple) -> tuple:
    """The rows of a research step's capture buffers that hold captures ([C + 1, R, H] -> [C + 1, n, H],
    and the captured logits likewise), sliced as the step is dispatched. Sliced when the step is
    collected, the slice would queue on the device behind the next step (dispatched by then), so reading
    one step's captures would wait for the next step as well, and the host and the device would take
    turns instead of overlapping. Their copy to the host is started here too (up to tens of MB for a
    prompt chunk capturing every position), so collect finds them there."""
    caps, cap_logits = captures
    n = research.rows_to_read
    if n < caps.shape[1]:  # R = T: only the captured rows, not every row of the step
        caps = caps[:, :n]
        if cap_logits is not None:
            cap_logits = cap_logits[:n]
    for a in (caps, cap_logits):  # their copy to the host starts as soon as the step is done
        if a is not None:
            a.copy_to_host_async()
    return caps, cap_logits


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: its device results (not yet read) and where each request's token sits in them."""

    sched: SchedulerOutput
    out: ModelRunnerOutput
    states: list[RequestState] = dataclasses.field(default_factory=list)  # of sched.scheduled, in order
    sampled: object = None  # device SamplerOutput; None when nothing was scheduled
    ids: jax.Array | None = None  # i32[ids_width] sampled ids on the device (the next step's prev_ids)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> row in `ids`
    # The sampler's dispatch when it waits on the token-rules thread for its masks; resolves to
    # (sampled, ids)
    token_rules: Future | None = None
    research: ResearchBatch | None = None  # what the step captures for whom (runner/research_batch.py)
    captures: tuple | None = None  # its captured rows on the device: ([C + 1, n, H], f32[n, V] | None)
    # A step that verifies proposals: each scheduled request's first sampler row (-1: samples nothing);
    # its k + 1 draws follow in order. None: row i of the sampler is request i's single draw.
    verify_rows: list[int] | None = None

    @property
    def verifies(self) -> bool:
        """Whether the step verifies proposals (a step after it needs its results on the host first)."""
        return self.verify_rows is not None

    @property
    def samples(self) -> bool:
        """Whether the step samples anything (results to collect)."""
        return self.sampled is not None or self.token_rules is not None

    def wait_dispatched(self) -> None:
        """Until the sampler is enqueued (`sampled` and `ids` set); raises what the token-rules thread
        raised."""
        if self.token_rules is not None:
            self.sampled, self.ids = self.token_rules.result()
            self.token_rules = None


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
        single_token_bucket: bool = False,
        kv_sharding=None,
        executable_cache: ExecutableCache | None = None,
        grammar_compiler=None,
        mesh=None,
    ):
        self.module = module
        self.params = params
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.hidden_size = getattr(getattr(module, "arch", None), "hidden_size", 0)
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
            single_token=single_token_bucket,
        )
        self.kv_sharding = kv_sharding
        self.mesh = mesh  # the tensor-parallel mesh the steps run under (None: one device)
        self._token_rules_pool: ThreadPoolExecutor | None = None
        # Penalty history (prompt + output ids) has one static width, so penalties never add a variant.
        self.history_width = 1 << max(6, (max_model_len - 1).bit_length())
        self.kv_caches: list | None = None
        self.swap: kvc.HostSwapSpace | None = None
        self.timing = StepTiming()
        # Compiles (or finds cached) the grammars of structured-output requests (jaxllm/structured_output).
        self.grammar_compiler = grammar_compiler
        self.requests = RequestStates(self._make_constraint)  # the runner's own state of every request
        # Sampled ids are also returned padded to one width, the next step's `prev_ids` (one shape).
        self.ids_width = max(s for _, s, _ in self.plan.all_shapes())
        self._zero_ids = None
        # Executables kept on disk across starts (executable_cache.py); a disabled one compiles every time.
        self.executables = executable_cache or ExecutableCache(None)
        self.compiler = StepCompiler(
            self._model_step_impl,
            self._sample_impl,
            plan=self.plan,
            module=module,
            vocab_size=vocab_size,
            history_width=self.history_width,
            ids_width=self.ids_width,
            executables=self.executables,
        )

    def _make_constraint(self, params) -> TokenConstraint | None:
        if not params.constrains_tokens:
            return None
        grammar = None
        if params.structured_outputs is not None:
            # LLMEngine.prepare_request refused structured outputs for a model without a tokenizer
            assert self.grammar_compiler is not None
            grammar = self.grammar_compiler.compile(params.structured_outputs)  # cached by then
        return TokenConstraint.create(params, self.vocab_size, grammar, params.bad_words_token_ids)

    # ---- the jitted pieces ---------------------------------------------------------------------------
    def _model_step_impl(
        self,
        params,
        kv_caches,
        packed,
        prev_ids,
        research=None,
        *,
        shape: tuple[int, int, int],
        all_logits: bool,
        research_logits: bool = False,
    ):
        v = unpack(packed, shape)
        if isinstance(research, PackedResearch):
            research = research.unpack()
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
        if research is None:
            hidden, kv_caches = self.module.apply({"params": params}, input_ids, kv_caches, md)
        else:  # a research variant (jaxllm/models/research_hooks.py): captures [C + 1, R, H] come back too
            hidden, kv_caches, captures = self.module.apply(
                {"params": params}, input_ids, kv_caches, md, research
            )
        rows = hidden if all_logits else hidden[v["logits_indices"]]
        logits = self.module.apply({"params": params}, rows, method="compute_logits")
        if research is None:
            return logits, kv_caches
        cap_logits = None
        if research_logits:
            cap_logits = self.module.apply(
                {"params": params}, hidden[research.cap_rows], method="compute_logits"
            )
        return logits, kv_caches, (captures, cap_logits)

    def _sample_impl(self, logits, md, *, flags: SamplerFlags):
        out = sample(logits, md, flags=flags)
        padded = jnp.zeros((self.ids_width,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
        return out, padded

    # ---- memory and compilation ----------------------------------------------------------------------
    def largest_step_temp_bytes(self) -> int:
        """Bytes a step needs beyond the weights and the KV cache, at the largest bucket."""
        return self.compiler.largest_step_temp_bytes(self.params, self.geometry)

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

    def compile_all(self, workers: int | None = None) -> float:
        """Compile every bucket and sampler variant ahead (compiler.py); seconds taken."""
        # The `prev_ids` of a step with none in flight, made here (in the caller's mesh context, as the
        # steps run) so that the first step traces nothing.
        self._zero_ids = jnp.zeros((self.ids_width,), jnp.int32)
        return self.compiler.compile_all(
            self.params,
            self.kv_caches,
            warm=self._warm_sequentially,
            sharded=self.kv_sharding is not None,
            workers=workers,
        )

    def compile_verification_ahead(self, max_tokens: int) -> float:
        """The variants of steps that verify proposals, up to `max_tokens` tokens (compiler.py); seconds.
        Under tensor parallelism they compile through jit at first use, as the research steps do."""
        if self.kv_sharding is not None:
            return 0.0
        return self.compiler.compile_verification_ahead(self.params, self.kv_caches, max_tokens)

    def compile_research_later(self) -> None:
        """Each bucket's model step with the smallest research inputs, traced now and compiled in the
        background (compiler.py): research requests then start without a compile. Not under tensor
        parallelism, which serves no research."""
        if self.kv_sharding is not None or not getattr(self.module, "supports_research", False):
            return
        self.compiler.compile_research_later(
            self.params,
            self.kv_caches,
            lambda t, all_rows, residual_only: pack_research(
                smallest_research_inputs(t, self.hidden_size, all_rows, residual_only)
            ),
        )

    def _warm_sequentially(self) -> None:
        """Run every bucket and sampler variant once through jit, on padding inputs (they write nothing)."""
        for t, s, b in self.plan.all_shapes():
            logits = self._run_model(empty_step_inputs((t, s, b)), all_logits=False)
            for flags in SamplerFlags.all_variants(MAX_LOGPROBS):
                smd = jax.device_put(self.compiler.empty_sampling_metadata(s, flags))
                out = self._sample_step(logits, smd, flags)
        jax.block_until_ready(out)

    def wait_for_background_compiles(self) -> None:
        self.compiler.wait_for_background_compiles()

    def num_compiling_in_background(self) -> int:
        return self.compiler.num_compiling_in_background()

    def num_compiled(self) -> int:
        return self.compiler.num_compiled()

    # ---- one step ------------------------------------------------------------------------------------
    def _run_model(self, inputs: StepInputs, *, all_logits: bool, prev_ids=None, research=None):
        """The step's logits (and the KV caches updated in place); with `research` (a ResearchBatch) also
        the device captures, as (logits, captures)."""
        if prev_ids is None:
            if self._zero_ids is None:
                self._zero_ids = jnp.zeros((self.ids_width,), jnp.int32)
            prev_ids = self._zero_ids
        # Host arrays go to the executable as they are: its C++ call path copies them to the device in
        # microseconds, where jax.device_put's Python path took 0.08 ms per array (0.45 ms for the
        # sampler's 13) on the development CPU, on the host's critical path of every step.
        args = (self.params, self.kv_caches, inputs.packed, prev_ids)
        if research is not None:
            on_device = research.packed  # two arrays (research_batch.py: PackedResearch)
            ahead = None
            if not all_logits:
                ahead = self.compiler.research_step(
                    inputs.shape, research_dims(research.inputs), research.logits
                )
            if ahead is not None:
                logits, self.kv_caches, captures = ahead(*args, on_device)
                return logits, captures
            step = self.compiler.step_jit(inputs.shape)
            logits, self.kv_caches, captures = step(
                *args,
                on_device,
                shape=inputs.shape,
                all_logits=all_logits,
                research_logits=research.logits,
            )
            return logits, captures
        ahead = (self.compiler.ahead_all_logits if all_logits else self.compiler.ahead_model).get(
            inputs.shape
        )
        if ahead is not None:
            logits, self.kv_caches = ahead(*args)
        else:
            step = self.compiler.step_jit(inputs.shape)
            logits, self.kv_caches = step(*args, shape=inputs.shape, all_logits=all_logits)
        return logits

    def _sample_step(self, logits, smd, flags: SamplerFlags):
        return self.compiler.sample(logits, smd, flags)  # numpy leaves: see _run_model

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.dispatch(sched))

    def dispatch(self, sched: SchedulerOutput, prev: InFlightStep | None = None) -> InFlightStep:
        """Start the step on the device and return without waiting for it. `prev` (async scheduling): the
        step still in flight, whose sampled ids feed this step's decode rows that need them."""
        if self.swap is not None:
            self.swap.swap_out(self.kv_caches, sched.blocks_to_swap_out)
            self.kv_caches = self.swap.swap_in(self.kv_caches, sched.blocks_to_swap_in)
        states = self.requests.update(sched)
        scheduled = sched.scheduled
        out = ModelRunnerOutput(req_ids=[sr.req_id for sr in scheduled])
        if not scheduled:
            return InFlightStep(sched, out)
        verify = any(sr.spec_token_ids for sr in scheduled)
        if prev is not None:
            if verify or prev.verifies:
                raise ValueError(
                    "a step that verifies proposals, or follows one, needs the previous step's results on "
                    "the host: schedule it after collecting that step"
                )
            prev.wait_dispatched()  # its token rules (another thread) are done with the states
        inputs = build_step_inputs(
            scheduled, states, self.plan, self.block_size, prev.rows if prev is not None else None
        )
        want_prompt_lp = self.requests.num_with_prompt_logprobs > 0 and any(
            _wants_prompt_logprobs(sr, st) for sr, st in zip(scheduled, states)
        )
        research = None
        if self.requests.num_with_research:
            research = build_research_batch(
                scheduled, states, inputs.cu_q_lens, inputs.shape[0], self.num_layers, self.hidden_size
            )
        logits = self._run_model(
            inputs,
            all_logits=want_prompt_lp or verify,
            prev_ids=prev.ids if prev is not None else None,
            research=research,
        )
        captures = None
        if research is not None:
            logits, captures = logits
            captures = _captured_rows(research, captures)
        if want_prompt_lp:
            self._collect_prompt_logprobs(scheduled, states, inputs, logits, out)
        if verify:
            step = InFlightStep(sched, out, states, research=research, captures=captures)
            self._dispatch_verification(step, inputs, logits)
            return step
        if want_prompt_lp:
            logits = logits[jnp.asarray(inputs.logits_indices)]

        # The forward pass is in flight: build the sampler's inputs meanwhile. A row's token k counts the
        # row's earlier tokens still in flight (async scheduling: the previous step's).
        rows, pending, rows_of, constrained = [], [], {}, []
        for i, (sr, st) in enumerate(zip(scheduled, states)):
            if sr.samples:
                rows.append(st.sampling)
                pending.append(st.num_in_flight)
                c = st.sampling.constraint
                if st.num_in_flight and c is not None and c.needs_last_token:
                    constrained.append(i)
                st.num_in_flight += 1
                rows_of[sr.req_id] = i
            else:
                rows.append(None)
                pending.append(0)
        flags = SamplerFlags.for_rows(rows, MAX_LOGPROBS, self.vocab_size)
        if flags.do_penalties and any(pending):
            raise ValueError(
                "penalties need every earlier token on the host: schedule such steps synchronously"
            )
        smd = build_sampling_metadata(
            rows,
            inputs.shape[1],
            self.vocab_size,
            history_width=self.history_width,
            flags=flags,
            pending=pending,
            token_rules=False,
        )
        step = InFlightStep(sched, out, states, rows=rows_of, research=research, captures=captures)
        if not constrained:
            apply_token_rules(smd, token_rules_rows(rows))
            step.sampled, step.ids = self._sample_step(logits, smd, flags)
            return step
        # Rows whose token rules depend on the tokens drawn so far need the one the previous step is still
        # sampling: its grammar consumes it before the row's mask is filled. Reading it back waits for the
        # previous step to finish; the token-rules thread does that wait, the fill and the sampler's
        # dispatch, while this thread goes on to collect the previous step and schedule the next.
        src = {i: prev.rows[scheduled[i].req_id] for i in constrained}
        rules = token_rules_rows(rows, copy=True)  # the step thread appends to the live lists meanwhile
        step.token_rules = self._token_rules_thread().submit(
            self._sample_after_token_rules, logits, smd, flags, rules, prev.ids, src
        )
        return step

    def _dispatch_verification(self, step: InFlightStep, inputs: StepInputs, all_logits) -> None:
        """Enqueue the sampler over every row of a step with proposals: request i samples at its last
        k_i + 1 rows (its own token's, then each proposal's), draw j as its token number len(output) + j."""
        num_tokens = inputs.num_tokens
        rows: list = [None] * num_tokens
        pending = [0] * num_tokens
        first = []
        for i, (sr, st) in enumerate(zip(step.sched.scheduled, step.states)):
            if not sr.samples:
                first.append(-1)
                continue
            k = len(sr.spec_token_ids)
            r0 = int(inputs.cu_q_lens[i + 1]) - 1 - k
            for j in range(k + 1):
                rows[r0 + j] = st.sampling
                pending[r0 + j] = j
            st.num_in_flight += 1
            first.append(r0)
        flags = SamplerFlags.for_rows(rows, MAX_LOGPROBS, self.vocab_size)
        smd = build_sampling_metadata(
            rows,
            inputs.shape[0],
            self.vocab_size,
            history_width=self.history_width,
            flags=flags,
            pending=pending,
        )
        step.sampled = self.compiler.sample_rows(all_logits, smd, flags)
        step.verify_rows = first

    def _token_rules_thread(self) -> ThreadPoolExecutor:
        if self._token_rules_pool is None:
            self._token_rules_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-token-rules")
        return self._token_rules_pool

    def _sample_after_token_rules(self, logits, smd, flags, rules, prev_ids, src: dict[int, int]):
        """On the token-rules thread: wait for the previous step's sampled ids, fill the token rules with
        them and enqueue the sampler (after the forward pass the step thread enqueued)."""
        ids = np.asarray(jax.device_get(prev_ids))  # the previous sampler has finished
        t0 = time.perf_counter()
        apply_token_rules(smd, rules, {i: [int(ids[j])] for i, j in src.items()})
        with mesh_context(self.mesh):
            sampled = self._sample_step(logits, smd, flags)
        self.timing.add("token_rules", time.perf_counter() - t0)
        return sampled

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a dispatched step, read its sampled tokens (and logprobs) back to the host and append
        them to the requests' states."""
        out = step.out
        if step.research is not None:
            caps, cap_logits = jax.device_get(step.captures)
            out.captures = step.research.split(np.asarray(caps), cap_logits)
        if not step.samples:
            return out
        t_wait = time.perf_counter()
        step.wait_dispatched()
        result = jax.device_get(step.sampled)
        self.timing.steps += 1
        self.timing.wait_s += time.perf_counter() - t_wait
        ids = np.asarray(result.token_ids).tolist()
        sampled_token_ids = out.sampled_token_ids
        verify_rows = step.verify_rows
        for i, (sr, st) in enumerate(zip(step.sched.scheduled, step.states)):
            if not sr.samples:
                sampled_token_ids.append([])
                continue
            if verify_rows is None:
                r0, tokens = i, [ids[i]]
            else:
                r0, k = verify_rows[i], len(sr.spec_token_ids)
                tokens = accepted_tokens(sr.spec_token_ids, ids[r0 : r0 + k + 1])
            sampled_token_ids.append(tokens)
            # A state dropped meanwhile (finished, preempted) is no longer reachable: appending is harmless.
            st.output_token_ids.extend(tokens)
            st.num_in_flight -= 1
            n = st.sampling.params.logprobs
            if n is not None and result.logprob_ids is not None:
                at = slice(r0, r0 + len(tokens))
                out.logprobs[sr.req_id] = TokenLogprobs(
                    token_ids=np.asarray(result.logprob_ids[at, : n + 1]),
                    logprobs=np.asarray(result.logprobs[at, : n + 1]),
                    ranks=np.asarray(result.ranks[at, : n + 1]),
                )
        return out

    def _collect_prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        states: list[RequestState],
        inputs: StepInputs,
        all_logits,
        out: ModelRunnerOutput,
    ) -> None:
        """Logprob of each prompt token given its prefix, for the positions this chunk computed."""
        t = inputs.shape[0]
        next_ids = np.zeros(t, np.int32)
        for i, (sr, st) in enumerate(zip(scheduled, states)):
            a = int(inputs.cu_q_lens[i])
            # The prompt token after each of the chunk's positions (none after the prompt's last one).
            stop = min(sr.start + sr.num_new_tokens, st.num_prompt_tokens - 1)
            if stop > sr.start:
                next_ids[a : a + stop - sr.start] = st.prompt_token_ids[sr.start + 1 : stop + 1]
        ids, lps, ranks = jax.device_get(
            self.compiler.prompt_logprobs(all_logits, jnp.asarray(next_ids), num_logprobs=MAX_LOGPROBS)
        )
        for i, (sr, st) in enumerate(zip(scheduled, states)):
            if not _wants_prompt_logprobs(sr, st):
                continue
            n = st.params.prompt_logprobs
            a = int(inputs.cu_q_lens[i])
            m = max(0, min(sr.num_new_tokens, st.num_prompt_tokens - 1 - sr.start))
            out.prompt_logprobs[sr.req_id] = TokenLogprobs(
                token_ids=np.asarray(ids[a : a + m, : n + 1]),
                logprobs=np.asarray(lps[a : a + m, : n + 1]),
                ranks=np.asarray(ranks[a : a + m, : n + 1]),
            )


def _wants_prompt_logprobs(sr: ScheduledRequest, st: RequestState) -> bool:
    return st.params.prompt_logprobs is not None and sr.start < st.num_prompt_tokens
