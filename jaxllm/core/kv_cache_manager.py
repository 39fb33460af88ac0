"""Per-request block tables on top of the `BlockPool`, with prefix caching by a hash chain of full blocks.

Data flow for one request:
  get_computed_blocks(req)   at admission: the longest run of cached full blocks that match the request's
                             tokens (never the whole sequence: the last token is always computed so the step
                             has logits to sample from) -> (blocks, num_computed_tokens)
  allocate_slots(req, n, new_computed_blocks)
                             takes references on the hit blocks and enough new blocks for n more tokens;
                             returns None (changing nothing) when the pool cannot supply them
  cache_blocks(req)          after a step computed tokens: registers the request's newly full blocks
  free(req)                  drops the references, tail of the sequence first

Block hashes of a request are computed lazily and kept until the request is freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from jaxllm.core.memory_report import KVMemoryReport, kv_memory_report
from jaxllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_block_ids: dict[str, list[int]] = {}  # the same tables as ids, for the step output
        self._req_to_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered in the cache
        self.prefix_cache_queries = 0  # tokens looked up at admission (cumulative)
        self.prefix_cache_hits = 0  # tokens found (cumulative)

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table."""
        return list(self._req_to_block_ids.get(request.request_id, ()))

    def block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first `num_full_blocks` blocks (extended as tokens arrive)."""
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        assert num_full_blocks * bs <= request.num_tokens
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding a prefix of the request's tokens, and how many tokens they cover."""
        params = request.sampling_params
        if not self.enable_caching or params.prompt_logprobs is not None or params.research is not None:
            # prompt logprobs and research captures need every prompt position computed; a steered
            # request's KV is its own
            return [], 0
        # At most num_tokens - 1 tokens may come from the cache: the last one must be computed.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in self.block_hashes(request, max_blocks):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- mutations -------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` tokens after the request's computed (and newly hit) tokens.

        Returns the newly allocated blocks ([] when the current blocks suffice), or None when the pool is
        short; then nothing has changed.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be >= 1")
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks and not new_computed_blocks:  # a running request (most steps: a decode in its last block)
            if cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) <= len(blocks):
                return []
        blocks = blocks if blocks is not None else []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        num_free = self.pool.num_free_blocks
        if new_computed_blocks:
            # Hit blocks that nobody references sit in the free queue; touching them takes them out of it.
            num_free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > num_free:
            return None

        if rid not in self.req_to_blocks and self.enable_caching:  # first allocation: count the lookup
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        ids = self._req_to_block_ids.setdefault(rid, [])
        if new_computed_blocks:
            assert not blocks, "prefix hits only at admission"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            self._num_cached_blocks[rid] = len(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        self.req_to_blocks[rid] = blocks
        return new_blocks

    def allocate_blocks(self, request: Request, num_blocks: int) -> list[KVCacheBlock] | None:
        """Fresh blocks for a request that has none (swap-in); None when the pool is short."""
        rid = request.request_id
        assert not self.req_to_blocks.get(rid)
        if num_blocks > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(num_blocks)
        self.req_to_blocks[rid] = list(blocks)
        self._req_to_block_ids[rid] = [b.block_id for b in blocks]
        self._num_cached_blocks[rid] = 0
        return blocks

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed tokens."""
        research = request.sampling_params.research
        if not self.enable_caching or (research is not None and research.edits_model):
            return  # the KV of an edited forward pass is no other request's prefix
        rid = request.request_id
        # Computed positions whose token ids are known (with async scheduling a step in flight may have
        # computed a position whose token is still being sampled).
        known = min(request.num_computed_tokens, request.num_tokens)
        num_cached = self._num_cached_blocks.get(rid, 0)
        if known // self.block_size <= num_cached:  # no block filled up since the last call (most steps)
            return
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(known // self.block_size, len(blocks))
        if num_full <= num_cached:
            return
        self.pool.cache_full_blocks(blocks, self.block_hashes(request, num_full), num_cached, num_full)
        self._num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's blocks, tail first, so its prefix stays cached longest."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self._req_to_block_ids.pop(rid, None)
        self.pool.free_blocks(reversed(blocks))
        self._req_to_hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)

    def memory_report(self, requests: Sequence[Request]) -> KVMemoryReport:
        """KV memory efficiency of the given (running) requests: filled token slots / allocated slots."""
        tables = [(self.get_block_ids(r), r.num_computed_tokens) for r in requests]
        return kv_memory_report(tables, self.block_size)
