"""Projections that share an input, held as one weight: q|k|v in `qkv_proj`, gate|up in `gate_up_proj`.

One GEMM instead of three (or two) reads the input once and lets cuBLAS tile one wide N; XLA's own dot
merging instead copies the concatenated weights every step (or runs them as a slower Triton GEMM).
vLLM holds these projections fused for the same reason (QKVParallelLinear, MergedColumnParallelLinear).

Layout of a fused weight's output columns, for N tensor-parallel shards (N = 1 without a mesh):

    [ part_0 of shard 0 | part_1 of shard 0 | ... | part_0 of shard 1 | part_1 of shard 1 | ... ]

so the column-parallel split P(None, "tp") (P("tp", None) of a weight held [out, in]) hands every device
its own slice of every part. A part whose heads are fewer than the shards (K/V heads when N > Hkv) has
each head repeated N / Hkv times first: the fused weight then has one K/V "slot" per device, the head
that device's query heads read, and the KV cache has the same N slots (jaxllm/parallel/sharding.py).
`fuse_columns` builds the weight from the checkpoint's separate parts (the loader); `split_columns` cuts
the product back into parts (the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class FusedPart:
    name: str  # the checkpoint's own module path inside a layer, e.g. "attn/k_proj"
    heads: int  # heads the part's columns hold in the checkpoint (an MLP part: its columns, width 1)
    head_width: int  # columns per head (head_dim; 1 for an MLP part)

    def slots(self, shards: int) -> int:
        """Heads in the fused weight: repeated to one per shard when there are fewer heads than shards."""
        return max(self.heads, shards)


@dataclass(frozen=True)
class FusedGroup:
    """A fused module `name` (e.g. "attn/qkv_proj") made of the separate `parts`, side by side."""

    name: str
    parts: tuple[FusedPart, ...]
    shards: int = 1

    def __post_init__(self) -> None:
        for p in self.parts:
            s = p.slots(self.shards)
            if s % self.shards or (s > p.heads and s % p.heads):
                raise ValueError(
                    f"{self.name}: {p.name} has {p.heads} heads, which {self.shards} shards can neither "
                    "split nor replicate evenly"
                )

    def part_widths(self) -> tuple[int, ...]:
        """Output columns of each part in the fused weight (all shards together)."""
        return tuple(p.slots(self.shards) * p.head_width for p in self.parts)

    @property
    def width(self) -> int:
        return sum(self.part_widths())


def fuse_columns(group: FusedGroup, parts: list, axis: int = -1):
    """The fused weight ([in, width]) or bias ([width]) from the parts' arrays ([in, heads * head_width] or
    [heads * head_width]) in checkpoint order. Numpy parts give a numpy array, fused on the host (the loader
    then puts it on the device once: on a GPU, each distinct shape fused there would compile its own small
    programs); otherwise a jax array. `axis` is the parts' output axis: 0 for a weight held [out, in] (a
    W8A8 qweight: jaxllm/quantization/scheme.py)."""
    xp = np if all(isinstance(x, np.ndarray) for x in parts) else jnp
    n = group.shards
    pieces = []
    for part, x in zip(group.parts, parts, strict=True):
        x = xp.asarray(x)
        a = axis % x.ndim
        lead, trail = x.shape[:a], x.shape[a + 1 :]
        x = x.reshape(*lead, part.heads, part.head_width, *trail)
        slots = part.slots(n)
        if slots > part.heads:  # slot s holds head s // (slots / heads)
            x = xp.repeat(x, slots // part.heads, axis=a)
        pieces.append(x.reshape(*lead, n, slots // n * part.head_width, *trail))
    fused = xp.concatenate(pieces, axis=a + 1)  # [..., N, per-shard width, ...]
    return fused.reshape(*lead, group.width, *trail)


def split_columns(group: FusedGroup, y: jnp.ndarray) -> list[jnp.ndarray]:
    """The parts of a fused product y [..., width], each [..., slots * head_width] (all shards' columns)."""
    n = group.shards
    lead = y.shape[:-1]
    y = y.reshape(*lead, n, group.width // n)
    out, start = [], 0
    for w in group.part_widths():
        out.append(y[..., start : start + w // n].reshape(*lead, w))
        start += w // n
    return out
