"""Proposals from a draft model: a smaller model of the same vocabulary decodes each speculating request's
next k tokens greedily, and the target verifies them in one forward pass (verify.py).

The draft runs on a ModelRunner of its own (its weights, its paged KV cache, its compiled steps), driven
by this proposer as the scheduler drives the target's: plain SchedulerOutputs, one request per row. Its
cache has a block pool of its own (no prefix caching), sized when the engine starts (`draft_num_blocks`).

One round, before a target step that verifies (the requests' tokens are all on the host):
  - catch up: each request's tokens that the draft cache does not hold yet go through the draft as one
    chunk (a request's whole prompt the first time; after that the tokens the last verification accepted
    beyond what the draft had proposed, one or two), and the step samples d_0 after the last of them;
  - k - 1 decode steps, each feeding the token the step before sampled (taken from that step's ids on
    the device, as under async scheduling: the steps are dispatched back to back and collected at the
    end), give d_1 .. d_{k-1}.
The draft's own RequestState follows the request's tokens: its outputs are replaced by the request's
before each round, and its cache is kept for the longest common prefix of what it held and what the
request now has (the proposals the target accepted keep their KV; a rejected proposal's slot is simply
written again).

Greedy proposals are one-hot, so verify.py's acceptance rule is exact rejection sampling for them: the
outputs keep the target's distribution, and a seeded or greedy request gets the same tokens as without
speculation, whatever the draft proposed.

A round whose catch-up does not fit the step budget (long prompts of requests new to the draft) goes in
chunks: such a request gets no proposals until its last chunk is in. Neither does one for which the
draft's pool has no free blocks left; it decodes one token per step meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.core.block_pool import BlockPool, KVCacheBlock
from jaxllm.request import Request
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0)
DRAFT_KV_SHARE = 0.25  # the most of the memory left for KV caches that the draft's cache takes


def draft_num_blocks(runner: ModelRunner, util: float, max_num_seqs: int) -> tuple[int, str]:
    """Blocks for the draft's cache, sized before the target's (which then fits in what is left): no more
    than `max_num_seqs` requests at full length can use, and at most DRAFT_KV_SHARE of the memory free
    for KV now (on a host platform, its KV budget)."""
    useful = max_num_seqs * runner.max_pages_per_seq + 1
    fits, why = runner.determine_num_blocks(util, None, max_num_seqs)
    n = max(2, min(useful, int(fits * DRAFT_KV_SHARE)))
    return n, f"{n} blocks: {useful} would hold {max_num_seqs} requests at full length; {why}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True, eq=False)
class _DraftState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    sent_blocks: int = 0  # of `blocks`, how many the draft runner holds in its block table
    computed: int = 0  # positions whose KV the draft cache holds for the request's tokens
    outputs_seen: int = 0  # the request's output length when its draft state was last synced
    known: bool = False  # the draft runner holds the request


class DraftModelProposer:
    def __init__(
        self, runner: ModelRunner, num_blocks: int, num_speculative_tokens: int, max_step_tokens: int
    ):
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_size = runner.block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.max_step_tokens = max_step_tokens  # tokens of one catch-up step (the draft's bucket plan)
        self._states: dict[str, _DraftState] = {}
        self._dropped: list[str] = []  # ids the draft runner still holds: dropped with the next step

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def forget(self, req_ids) -> None:
        """Free the draft's cache of requests that no longer speculate (finished, preempted, switched off)."""
        for rid in req_ids:
            st = self._states.pop(rid, None)
            if st is None:
                continue
            self.pool.free_blocks(reversed(st.blocks))
            if st.known:
                self._dropped.append(rid)

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Proposals (k tokens each) for the decoding requests given, by request id; a request left out
        gets none this round (its catch-up is not complete, or the pool is full)."""
        k, bs = self.k, self.block_size
        held = self.runner.requests.by_id
        new_requests, first, lengths = [], [], {}
        budget = self.max_step_tokens
        for r in requests:
            rid = r.request_id
            st = self._states.get(rid)
            if st is None:
                st = self._states[rid] = _DraftState()
            out = r.output_token_ids
            total = r.num_tokens
            if st.known:
                mine = held[rid].output_token_ids  # the draft runner's list of this request's outputs
                base = st.outputs_seen
                same = base + _common_prefix(mine[base:], out[base:])
                st.computed = min(st.computed, r.num_prompt_tokens + same)
                del mine[base:]
                mine.extend(out[base:])
            st.outputs_seen = len(out)
            # Slots up to position total + k - 2: the last proposal is sampled, never fed.
            need = -(-(total + k - 1) // bs) - len(st.blocks)
            if need > self.pool.num_free_blocks:
                continue
            if need > 0:
                st.blocks.extend(self.pool.get_new_blocks(need))
            n = min(total - st.computed, budget)
            if n < 1:
                continue
            budget -= n
            ids = [b.block_id for b in st.blocks]
            if not st.known:
                new_requests.append(
                    NewRequestData(rid, r.prompt_token_ids, GREEDY, 0, None, ids, st.computed, list(out))
                )
                st.known, new_ids = True, []
            else:
                new_ids = ids[st.sent_blocks :]
            st.sent_blocks = len(ids)
            samples = st.computed + n == total
            first.append(ScheduledRequest(rid, n, st.computed, new_ids, samples=samples))
            st.computed += n
            if samples:
                lengths[rid] = total
        if not first:
            return {}
        runner = self.runner
        sched = SchedulerOutput(
            scheduled=first,
            new_requests=new_requests,
            num_scheduled_tokens=sum(s.num_new_tokens for s in first),
            finished_request_ids=self._dropped,
        )
        self._dropped = []
        steps = [runner.dispatch(sched)]
        decoding = list(lengths)
        for j in range(1, k if decoding else 0):
            rows = [ScheduledRequest(rid, 1, lengths[rid] + j - 1, []) for rid in decoding]
            steps.append(
                runner.dispatch(SchedulerOutput(scheduled=rows, num_scheduled_tokens=len(rows)), steps[-1])
            )
        for step in steps:
            runner.collect(step)
        proposals = {}
        for rid in decoding:
            st = self._states[rid]
            st.computed = lengths[rid] + k - 1
            start = st.outputs_seen
            proposals[rid] = held[rid].output_token_ids[start : start + k]
        return proposals
