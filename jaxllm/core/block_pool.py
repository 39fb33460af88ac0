"""The pool of KV cache blocks on the device: ids, reference counts, the free queue and the prefix cache.

A block is a page of `block_size` token slots in every layer's KV cache. The pool only hands out ids;
the runner owns the arrays. Block 0 is reserved as the null block: it is never handed out, so the runner
may point unused block-table entries (and padding) at it.

Data flow:
  get_new_blocks(n)      takes n blocks from the head of the free queue (evicting their cached hash)
  touch(blocks)          a prefix-cache hit: ref_cnt += 1, and a block with ref_cnt 0 leaves the free queue
  free_blocks(blocks)    ref_cnt -= 1; a block reaching 0 goes to the tail of the free queue, keeping its
                         hash, so unreferenced cached blocks are evicted least-recently-freed first
  cache_full_blocks(...) gives full blocks their hash and registers them in the hash -> block map
  get_cached_block(hash) looks a full block up by the hash chain of its tokens

The caller frees a request's blocks in reverse order so the tail of a sequence (the part least likely to
be shared) is evicted before its prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

NULL_BLOCK_ID = 0


class BlockHash(NamedTuple):
    """The identity of a full block: a hash of (parent hash, tokens) plus the tokens, compared exactly."""

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash-chain link of one full block; equal only for the same tokens after the same prefix."""
    tokens = tuple(token_ids)
    parent_value = None if parent is None else parent.hash_value
    return BlockHash(hash((parent_value, tokens)), tokens)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved as the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        # block_id -> block, head = next to hand out (least recently freed), tail = most recently freed.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b.block_id != NULL_BLOCK_ID
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not: all of them can be handed out."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue head to tail (the order in which blocks would be handed out)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    # -- mutations -------------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to (cached) blocks; one with no references leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given (eviction) order."""
        for block in blocks:
            assert block.ref_cnt > 0 and block.block_id != NULL_BLOCK_ID, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under block_hashes of the same index.

        A hash already owned by another block is left there; this block then stays uncached (two requests
        that computed the same tokens at once: the first one to cache wins).
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None:  # came from the cache (a prefix hit) or cached earlier
                assert block.block_hash == h
                continue
            if h in self._cached:
                continue
            block.block_hash = h
            self._cached[h] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        if self._cached.get(h) is block:
            del self._cached[h]
        block.block_hash = None
