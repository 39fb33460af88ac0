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
("Input buffer 1 is not 256-byte aligned", the block tables, measured on the H200).
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

    row = 0
    for i, (sr, st) in enumerate(zip(scheduled, states)):
        n = sr.num_new_tokens
        start = sr.start
        table = st.block_ids
        block_tables[i, : len(table)] = table
        if n == 1 and start >= st.num_tokens:  # input still being sampled by the previous step
            src = None if prev_rows is None else prev_rows.get(sr.req_id)
            if src is None:
                raise ValueError(
                    f"request {sr.req_id!r}: token {start} is not known and the previous step did not sample it"
                )
            prev_src[row] = src
            positions[row] = start
            slot_mapping[row] = table[start // block_size] * block_size + start % block_size
        elif n == 1:  # decode row: scalar writes, no temporary arrays
            input_ids[row] = st.token_ids_slice(start, start + 1)[0]
            positions[row] = start
            slot_mapping[row] = table[start // block_size] * block_size + start % block_size
        else:
            input_ids[row : row + n] = st.token_ids_slice(start, start + n)
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[row : row + n] = pos
            slot_mapping[row : row + n] = block_tables[i, pos // block_size] * block_size + pos % block_size
        kv_lens[i] = start + n
        row += n
        cu[i + 1] = row
        logits_indices[i] = row - 1
    cu[n_seq + 1 :] = row
    inputs.num_seqs[0] = n_seq
    inputs.num_tokens = n_tok
    return inputs
