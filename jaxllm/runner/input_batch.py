"""Turn a `SchedulerOutput` into the fixed-shape host arrays of one step (numpy only).

Requests keep the scheduler's order. Row layout of the flattened batch: request r's new tokens occupy
rows cu_q_lens[r]:cu_q_lens[r+1]; rows past the last request are padding (slot -1, token 0). Logits are
computed only at `logits_indices` (the last row of each request; padding sequences point at row 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.runner.buckets import BucketPlan
from jaxllm.scheduler_output import SchedulerOutput


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
    num_tokens: int  # real (unpadded) rows
    shape: tuple[int, int, int]  # (T, S, B) bucket


def build_step_inputs(sched: SchedulerOutput, plan: BucketPlan, block_size: int) -> StepInputs:
    reqs = sched.scheduled
    n_tok = sum(r.num_new_tokens for r in reqs)
    n_seq = len(reqs)
    max_pages = max((len(r.block_ids) for r in reqs), default=1)
    t, s, b = plan.shape_for(n_tok, n_seq, max_pages)

    input_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.full(t, -1, np.int32)
    block_tables = np.zeros((s, b), np.int32)
    kv_lens = np.zeros(s, np.int32)
    cu = np.zeros(s + 1, np.int32)
    logits_indices = np.zeros(s, np.int32)

    row = 0
    for i, sr in enumerate(reqs):
        n = sr.num_new_tokens
        start = sr.start
        input_ids[row : row + n] = sr.request.token_ids_slice(start, start + n)
        pos = np.arange(start, start + n, dtype=np.int32)
        positions[row : row + n] = pos
        table = np.asarray(sr.block_ids, np.int32)
        slot_mapping[row : row + n] = table[pos // block_size] * block_size + pos % block_size
        block_tables[i, : len(table)] = table
        kv_lens[i] = start + n
        row += n
        cu[i + 1] = row
        logits_indices[i] = row - 1
    cu[n_seq + 1 :] = row
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        kv_lens=kv_lens,
        cu_q_lens=cu,
        num_seqs=np.array([n_seq], np.int32),
        logits_indices=logits_indices,
        num_tokens=n_tok,
        shape=(t, s, b),
    )
