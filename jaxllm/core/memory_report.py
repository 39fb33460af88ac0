"""KV memory efficiency: how many allocated token slots hold a token's K/V.

Input: each sequence's block table and how many of its tokens are in the cache. A block shared by several
sequences (a prefix-cache hit) counts once, with the most slots any of them fills in it. Paged attention's
waste is the unfilled tail of each sequence's last block, so efficiency is close to 1; a contiguous
max_model_len reservation per sequence would score num_tokens / max_model_len.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVMemoryReport:
    num_blocks: int  # distinct blocks referenced
    used_slots: int  # token slots that hold K/V
    allocated_slots: int  # num_blocks * block_size
    logical_slots: int  # sum over sequences of their tokens (shared prefixes counted per sequence)

    @property
    def efficiency(self) -> float:
        """used / allocated slots (1.0 when nothing is allocated)."""
        return self.used_slots / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def sharing_ratio(self) -> float:
        """Logical tokens per used slot: > 1 when prefix caching shares blocks."""
        return self.logical_slots / self.used_slots if self.used_slots else 1.0


def kv_memory_report(tables: Iterable[tuple[Sequence[int], int]], block_size: int) -> KVMemoryReport:
    """`tables`: (block ids in order, number of tokens stored) per sequence."""
    filled: dict[int, int] = {}
    logical = 0
    for block_ids, num_tokens in tables:
        if num_tokens > len(block_ids) * block_size:
            raise ValueError(f"num_tokens={num_tokens} exceeds {len(block_ids)} blocks of {block_size}")
        logical += num_tokens
        for i, block_id in enumerate(block_ids):
            n = min(block_size, max(0, num_tokens - i * block_size))
            filled[block_id] = max(filled.get(block_id, 0), n)
    used = sum(filled.values())
    return KVMemoryReport(
        num_blocks=len(filled),
        used_slots=used,
        allocated_slots=len(filled) * block_size,
        logical_slots=logical,
    )
