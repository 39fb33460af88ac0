"""Turn one step's scheduled requests (and the runner's state of each) into fixed-shape host arrays.

Requests keep the scheduler's order; token ids and block tables come from the runner's own
`RequestState`s (request_state.py), read in place. Row layout of the flattened batch: request r's new
tokens occupy rows cu_q_lens[r]:cu_q_lens[r+1]; rows past the last request are padding (slot -1,
token 0). Logits are computed only at `logits_indices` (the last row of each request; padding
sequences point at row 0).

All arrays of a step are views into ONE int32 buffer (`StepInputs.packed`, laid out by `packed_layout`),
so a step costs a single host-to-device copy; the jitted step slices it apart with static offsets.
Each array starts at a multiple of FIELD_ALIGN elements (256 bytes): XLA hands a kernel a static slice of
the step's buffer without copying it, and Mosaic GPU kernels refuse operands that are not 256-byte aligned
(they fail with "Input buffer N is not 256-byte aligned").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.request_state import RequestState
from jaxllm.scheduler_output import ScheduledRequest


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T] (-1: padding)
    block_tables: np.ndarray  # i32[S, B]
    kv_lens: np.ndarray  # i32[S]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]
    prev_src: np.ndarray  # i32[T] row of the previous step's sampled ids feeding this row; -1: input_ids
    num_tokens: int  # real (unpadded) rows
    shape: tuple[int, int, int]  # (T, S, B) bucket
    packed: np.ndarray  # i32[packed_size(T, S, B)]: every array above, as views into this buffer


FIELD_ALIGN = 64  # int32 elements: 256 bytes


# Field order and length of each array inside the packed buffer.
def packed_layout(t: int, s: int, b: int) -> list[tuple[str, int, tuple[int, ...]]]:
    return [
        ("input_ids", t, (t,)),
        ("positions", t, (t,)),
        ("slot_mapping", t, (t,)),
        ("kv_lens", s, (s,)),
        ("cu_q_lens", s + 1, (s + 1,)),
        ("num_seqs", 1, (1,)),
        ("logits_indices", s, (s,)),
        ("block_tables", s * b, (s, b)),
        ("prev_src", t, (t,)),
    ]


def _aligned(n: int) -> int:
    return -(-n // FIELD_ALIGN) * FIELD_ALIGN


def packed_size(t: int, s: int, b: int) -> int:
    return sum(_aligned(n) for _, n, _ in packed_layout(t, s, b))


def unpack(packed, shape: tuple[int, int, int]) -> dict:
    """Split a packed buffer (numpy or jax, 1-D) into its named arrays; offsets are static multiples of
    FIELD_ALIGN."""
    out, off = {}, 0
    for name, n, shp in packed_layout(*shape):
        out[name] = packed[off : off + n].reshape(shp)
        off += _aligned(n)
    return out


def empty_step_inputs(shape: tuple[int, int, int]) -> StepInputs:
    """Padding inputs of a bucket: no tokens, every slot -1 (the step writes nothing)."""
    buf = np.zeros(packed_size(*shape), np.int32)
    v = unpack(buf, shape)
    v["slot_mapping"][:] = -1
    v["prev_src"][:] = -1
    return StepInputs(**v, num_tokens=0, shape=shape, packed=buf)


def build_step_inputs(
    scheduled: Sequence[ScheduledRequest],
    states: Sequence[RequestState],
    plan: BucketPlan,
    block_size: int,
    prev_rows: dict[str, int] | None = None,
) -> StepInputs:
    """`states[i]` is the runner's state of `scheduled[i]` (its block table already extended by the
    step's delta). `prev_rows` (async scheduling): request id -> its row in the previous step's sampled
    ids, for decode rows whose input token that step is still sampling (start == the state's num_tokens)."""
    n_tok = sum(sr.num_new_tokens for sr in scheduled)
    n_seq = len(scheduled)
    max_pages = max((len(st.block_ids) for st in states), default=1)
    t, s, b = plan.shape_for(n_tok, n_seq, max_pages)

    inputs = empty_step_inputs((t, s, b))
    input_ids, positions, slot_mapping = inputs.input_ids, inputs.positions, inputs.slot_mapping
    block_tables, kv_lens, cu = inputs.block_tables, inputs.kv_lens, inputs.cu_q_lens
    logits_indices, prev_src = inputs.logits_indices, inputs.prev_src

    # One pass over the requests; single-token rows (decodes) collect their values in Python lists and
    # each field is written with one numpy call at the end: a numpy element write costs far more than a
    # list append, and a decode row has six. Block tables are copied from each state's numpy mirror,
    # since converting a Python list row by row was the largest cost of a decode step's inputs.
    one_rows, one_pos, one_slots = [], [], []  # single-token rows: row, position, KV slot
    tok_rows, tok_ids = [], []  # ... whose input token is known on the host
    src_rows, src_vals = [], []  # ... whose input the previous step is still sampling
    ends, rows_end = [], []  # per request: kv length (start + n), its last row + 1
    row = 0
    for i, (sr, st) in enumerate(zip(scheduled, states)):
        n = sr.num_new_tokens
        start = sr.start
        table = st.block_ids
        nb = len(table)
        block_tables[i, :nb] = st.block_array[:nb]
        if n == 1:
            one_rows.append(row)
            one_pos.append(start)
            one_slots.append(table[start // block_size] * block_size + start % block_size)
            if start < st.num_tokens:
                tok_rows.append(row)
                tok_ids.append(st.token_at(start))
            else:  # input still being sampled by the previous step
                src = None if prev_rows is None else prev_rows.get(sr.req_id)
                if src is None:
                    raise ValueError(
                        f"request {sr.req_id!r}: token {start} is not known and the previous step did "
                        "not sample it"
                    )
                src_rows.append(row)
                src_vals.append(src)
        else:
            spec = sr.spec_token_ids
            if spec:  # the request's last token(s), then the proposals (speculative decoding)
                known = start + n - len(spec)
                if known != st.num_tokens:
                    raise ValueError(
                        f"request {sr.req_id!r}: {len(spec)} proposals after token {known}, but the runner "
                        f"knows {st.num_tokens} tokens"
                    )
                input_ids[row : row + n] = st.token_ids_slice(start, known) + spec
            else:
                input_ids[row : row + n] = st.token_ids_slice(start, start + n)
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[row : row + n] = pos
            slot_mapping[row : row + n] = block_tables[i, pos // block_size] * block_size + pos % block_size
        row += n
        ends.append(start + n)
        rows_end.append(row)
    if one_rows:
        # Decodes come first in the scheduler's order: then their rows are 0..k-1, a slice.
        at = slice(0, len(one_rows)) if one_rows[-1] == len(one_rows) - 1 else one_rows
        positions[at] = one_pos
        slot_mapping[at] = one_slots
        if tok_rows:
            input_ids[at if not src_rows else tok_rows] = tok_ids
        if src_rows:
            prev_src[at if not tok_rows else src_rows] = src_vals
    kv_lens[:n_seq] = ends
    cu[1 : n_seq + 1] = rows_end
    cu[n_seq + 1 :] = row
    logits_indices[:n_seq] = cu[1 : n_seq + 1] - 1
    inputs.num_seqs[0] = n_seq
    inputs.num_tokens = n_tok
    return inputs
