"""Host half of research in a step: the scheduled requests' ResearchParams -> ResearchInputs, and the
captured arrays the step returns -> each request's activations by site and position.

    build_research_batch(scheduled, states, cu_q_lens, T, num_layers, hidden) -> ResearchBatch | None
        (None: no scheduled request asks for research, the step runs its plain program)
    ResearchBatch.inputs                    numpy ResearchInputs, padded to pow2 buckets
    ResearchBatch.split(captures, logits)  -> {req_id: {site name: (positions, array [n, H or V])}}

Buckets: rows R are 32 while the step captures at most 32 rows, else the step's T (a prompt chunk that
captures every position): two sizes per token bucket, both compiled ahead, where the powers of two in
between would each compile through jit in the middle of serving (seconds of a stalled step at the 8B
shape). Capture slots C are the next power of two of what the step needs, at least 8 even when it
captures nothing; the intervention slots (steers J, scales M, head scales K, patches P) the next powers
of two of theirs, at least 8 even with none (a step that only captures runs the program of one that
edits, with neutral values): a handful of variants per token bucket, whatever the mix of layers, sites
and heads (models/research_hooks.py). The variants compiled ahead (`smallest_research_inputs`,
runner/compiler.py) take up to 8 sites and 8 steers, scales, head scales and patches, with R = 32 and
R = T; the slots cost little (steering is a [J, T] x [J, H] product per site). Each comes twice: for
steps whose slots all sit on residual sites, and for any site (models/research_hooks.py says why). Only
the rows a step captured are read back (`ResearchBatch.rows_to_read`), not the whole [C + 1, R, H] buffer.

    research_dims(inputs) -> (R, C, J, M, K, P, residual_only)   the variant's key
    pack_research(inputs) -> PackedResearch       what the step is called with: two arrays (ints, floats)

Packed, because each array handed to an executable is its own host-to-device copy with its own
completion callback: the 13 arrays of ResearchInputs cost the host about 1 ms a step on an H100 where
the step's own packed inputs cost one copy. The dims ride in the pytree's static part, so the step
unpacks them with static slices (`PackedResearch.unpack`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxllm.models.research_hooks import ResearchInputs, is_residual_code, site_code
from jaxllm.runner.request_state import RequestState
from jaxllm.scheduler_output import ScheduledRequest

_MIN_ROWS, _MIN_SLOTS, _MIN_EDITS = 32, 8, 8


def _bucket(n: int, floor: int) -> int:
    """The next power of two of n, at least `floor` (also for n = 0: see the module docstring)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


_INT_FIELDS = ("cap_rows", "cap_codes", "steer_codes", "scale_codes", "head_layers", "head_index", "patch_codes",
               "patch_rows")  # fmt: skip
_FLOAT_FIELDS = ("steer_vectors", "steer_scales", "scale_factors", "head_factors", "patch_values")


@jax.tree_util.register_pytree_node_class
class PackedResearch:
    """ResearchInputs as one i32 and one f32 array (module docstring); `dims` (R, C, J, M, K, P,
    residual_only, T, H) is the pytree's static part."""

    def __init__(self, ints, floats, dims: tuple[int, ...]):
        self.ints, self.floats, self.dims = ints, floats, tuple(dims)

    def tree_flatten(self):
        return (self.ints, self.floats), self.dims

    @classmethod
    def tree_unflatten(cls, dims, children):
        return cls(*children, dims)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        r, c, j, m, k, p, _, t, h = self.dims
        return dict(
            cap_rows=(r,), cap_codes=(c,), steer_codes=(j,), scale_codes=(m,), head_layers=(k,), head_index=(k,),
            patch_codes=(p,), patch_rows=(p,), steer_vectors=(j, h), steer_scales=(j, t), scale_factors=(m, t),
            head_factors=(k, t), patch_values=(p, h),
        )  # fmt: skip

    def unpack(self) -> ResearchInputs:
        """The ResearchInputs, sliced out of the two arrays (inside the step: static slices)."""
        shapes, out = self._shapes(), {}
        for names, flat in ((_INT_FIELDS, self.ints), (_FLOAT_FIELDS, self.floats)):
            at = 0
            for name in names:
                size = int(np.prod(shapes[name]))
                out[name] = flat[at : at + size].reshape(shapes[name])
                at += size
        return ResearchInputs(**out, residual_only=bool(self.dims[6]))


def pack_research(ri: ResearchInputs) -> PackedResearch:
    """The numpy ResearchInputs as a PackedResearch (two host arrays, one copy each to the device)."""
    dims = (*research_dims(ri), int(ri.steer_scales.shape[1]), int(ri.steer_vectors.shape[1]))
    ints = np.concatenate([np.asarray(getattr(ri, n), np.int32).reshape(-1) for n in _INT_FIELDS])
    floats = np.concatenate([np.asarray(getattr(ri, n), np.float32).reshape(-1) for n in _FLOAT_FIELDS])
    return PackedResearch(ints, floats, dims)


def research_dims(ri: ResearchInputs | PackedResearch) -> tuple[int, ...]:
    """(R, C, J, M, K, P, residual_only): the slot sizes and sites that, with the token bucket, pick the
    compiled variant."""
    if isinstance(ri, PackedResearch):
        return ri.dims[:7]
    sizes = (ri.cap_rows, ri.cap_codes, ri.steer_codes, ri.scale_codes, ri.head_layers, ri.patch_codes)
    return (*(int(a.shape[0]) for a in sizes), int(ri.residual_only))


def _capture_rows_bucket(n: int, num_tokens: int) -> int:
    """R for a step capturing n of its num_tokens rows: the floor, or every row of the step."""
    return _MIN_ROWS if n <= _MIN_ROWS else max(num_tokens, _MIN_ROWS)


def smallest_research_inputs(
    num_tokens: int, hidden_size: int, all_rows: bool = False, residual_only: bool = False
) -> ResearchInputs:
    """Neutral ResearchInputs of a `num_tokens`-token step at the floors (`all_rows`: with R = the step's
    tokens, as a step capturing more than 32 rows has; `residual_only`: the variant of residual sites):
    the variants compiled ahead."""
    ri = _research_inputs([], [], [], [], [], [], num_tokens, hidden_size, residual_only=residual_only)
    if all_rows:
        r = _capture_rows_bucket(num_tokens, num_tokens)  # the R of a step capturing all its rows
        ri = dataclasses.replace(ri, cap_rows=np.zeros(r, np.int32))
    return ri


@dataclass
class _Wanted:
    """One request's captures in this step: its positions, their rows in R, and its sites' slots."""

    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # indices into R
    slots: dict[str, int] = field(default_factory=dict)  # site name -> slot in C (-1: logits)


@dataclass
class ResearchBatch:
    inputs: ResearchInputs  # numpy leaves
    logits: bool  # the step also returns the logits of the captured rows
    wanted: dict[str, _Wanted]

    @property
    def packed(self) -> PackedResearch:
        """What the step is called with."""
        return pack_research(self.inputs)

    @property
    def rows_to_read(self) -> int:
        """How many of R's rows to read back: the captured ones (the rest is padding), rounded up to a power
        of two (at least 32) so that few slicing programs are made."""
        captured = sum(len(w.rows) for w in self.wanted.values())
        return min(int(self.inputs.cap_rows.shape[0]), _bucket(captured, _MIN_ROWS))

    def split(self, captures: np.ndarray, logits: np.ndarray | None) -> dict[str, dict[str, tuple]]:
        """captures [C + 1, R, H], logits f32[R, V] | None -> per request, per site: (positions, array)."""
        out = {}
        for rid, w in self.wanted.items():
            if not w.positions:
                continue
            rows = np.asarray(w.rows)
            got = {}
            for site, slot in w.slots.items():
                got[site] = (list(w.positions), (logits if slot < 0 else captures[slot])[rows])
            out[rid] = got
        return out


def build_research_batch(
    scheduled: Sequence[ScheduledRequest],
    states: Sequence[RequestState],
    cu_q_lens: np.ndarray,  # i32[S + 1]
    num_tokens: int,  # T
    num_layers: int,
    hidden_size: int,
) -> ResearchBatch | None:
    asking = [(i, sr, st) for i, (sr, st) in enumerate(zip(scheduled, states)) if st.params.research]
    if not asking:
        return None
    codes: dict[int, int] = {}  # site code -> slot
    cap_rows: list[int] = []
    steers: list[tuple[int, np.ndarray, float, int, int]] = []  # code, vector, scale, first row, end row
    scales: list[tuple[int, float, int, int]] = []  # code, factor, first row, end row
    heads: list[tuple[int, int, float, int, int]] = []  # layer, head, factor, first row, end row
    patches: list[tuple[int, int, np.ndarray]] = []  # code, row, vector
    wanted: dict[str, _Wanted] = {}
    want_logits = False
    for i, sr, st in asking:
        rp = st.params.research
        a, n = int(cu_q_lens[i]), sr.num_new_tokens
        for s in rp.steer:
            steers.append((site_code(s.parsed, num_layers), s.vector, s.scale, a, a + n))
        for s in rp.scale:
            if s.head is None:
                scales.append((site_code(s.parsed, num_layers), s.factor, a, a + n))
            else:
                heads.append((s.parsed.layer, s.head, s.factor, a, a + n))
        for p in rp.patch:
            if sr.start <= p.position < sr.start + n:
                patches.append((site_code(p.parsed, num_layers), a + p.position - sr.start, p.vector))
        if not rp.capture:
            continue
        w = wanted[sr.req_id] = _Wanted()
        num_prompt = len(st.prompt_token_ids)
        for k in range(n):
            if rp.wants_position(sr.start + k, num_prompt):
                w.positions.append(sr.start + k)
                w.rows.append(len(cap_rows))
                cap_rows.append(a + k)
        for site in rp.capture_sites:
            if site.kind == "logits":
                w.slots[str(site)] = -1
                want_logits = True
                continue
            code = site_code(site, num_layers)
            w.slots[str(site)] = codes.setdefault(code, len(codes))
    slot_codes = sorted(codes, key=codes.get)  # slot k holds the k-th code seen
    site_codes = [*slot_codes, *(x[0] for x in steers), *(x[0] for x in scales), *(x[0] for x in patches)]
    residual_only = not heads and all(is_residual_code(code, num_layers) for code in site_codes)
    inputs = _research_inputs(
        cap_rows, slot_codes, steers, scales, heads, patches, num_tokens, hidden_size, want_logits,
        residual_only,
    )  # fmt: skip
    return ResearchBatch(inputs, want_logits, wanted)


def _research_inputs(
    cap_rows: list[int],
    slot_codes: list[int],
    steers: list,
    scales: list,
    heads: list,
    patches: list,
    num_tokens: int,
    hidden_size: int,
    logits: bool = False,
    residual_only: bool = False,
) -> ResearchInputs:
    """The padded numpy ResearchInputs of a step's captures and edits (see build_research_batch). With
    captured logits (f32[R, V], compiled through jit anyway) R stays the power of two of the rows: R = T
    would hold the logits of every row of a prompt chunk."""
    r = _bucket(len(cap_rows), _MIN_ROWS) if logits else _capture_rows_bucket(len(cap_rows), num_tokens)
    c = _bucket(len(slot_codes), _MIN_SLOTS)
    rows = np.zeros(r, np.int32)
    rows[: len(cap_rows)] = cap_rows
    codes = np.full(c, -1, np.int32)
    codes[: len(slot_codes)] = slot_codes
    # The intervention slots never drop to 0: a step that only captures runs the program of one that
    # edits (factors 1, scales 0, no patch rows).
    j, m, k, p = (_bucket(len(x), _MIN_EDITS) for x in (steers, scales, heads, patches))
    steer_codes, vectors = np.full(j, -1, np.int32), np.zeros((j, hidden_size), np.float32)
    steer_scales = np.zeros((j, num_tokens), np.float32)
    for q, (code, vec, scale, lo, hi) in enumerate(steers):
        steer_codes[q], vectors[q], steer_scales[q, lo:hi] = code, vec, scale
    scale_codes, scale_factors = np.full(m, -1, np.int32), np.ones((m, num_tokens), np.float32)
    for q, (code, factor, lo, hi) in enumerate(scales):
        scale_codes[q], scale_factors[q, lo:hi] = code, factor
    head_layers, head_index = np.full(k, -1, np.int32), np.zeros(k, np.int32)
    head_factors = np.ones((k, num_tokens), np.float32)
    for q, (layer, head, factor, lo, hi) in enumerate(heads):
        head_layers[q], head_index[q], head_factors[q, lo:hi] = layer, head, factor
    patch_codes, patch_rows = np.full(p, -1, np.int32), np.full(p, num_tokens, np.int32)
    patch_values = np.zeros((p, hidden_size), np.float32)
    for q, (code, row, vec) in enumerate(patches):
        patch_codes[q], patch_rows[q], patch_values[q] = code, row, vec
    return ResearchInputs(
        rows,
        codes,
        steer_codes,
        vectors,
        steer_scales,
        scale_codes,
        scale_factors,
        head_layers,
        head_index,
        head_factors,
        patch_codes,
        patch_rows,
        patch_values,
        residual_only,
    )
