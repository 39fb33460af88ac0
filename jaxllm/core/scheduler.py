"""The scheduler: which requests get how many new tokens this step, and what happens to their results.

There are no prefill or decode phases. Each `schedule()` hands out at most `max_num_batched_tokens`
tokens to at most `max_num_seqs` requests:
  1. running requests, decodes first (one token each) then unfinished prompt chunks; when the pool is
     short, the most recently admitted running request (the lowest priority one under "priority") is
     preempted: swapped to host memory when host blocks are free, else freed to be recomputed;
  2. if nothing was preempted, waiting requests in queue order (FCFS, or (priority, arrival)): swapped
     ones get device blocks back (blocks_to_swap_in), new and preempted ones look up the prefix cache
     and get a prompt chunk (the remaining budget with chunked prefill, else the whole prompt or none).
`schedule()` advances each scheduled request's num_computed_tokens and counts the token the step will
sample as a placeholder; `update_from_output()` appends the sampled tokens, applies the stop conditions,
caches newly full blocks and frees finished requests.

The runner never sees a `Request` (scheduler_output.py): a request admitted from the waiting queue (new,
or resumed after a preemption, whose runner state was dropped) goes out whole once as NewRequestData; a
running one only as a delta, with the blocks `allocate_slots` appended for it this step. The scheduler
remembers which Requests each output scheduled until its results are applied, so a result never lands on
a later request that reuses a finished one's id.

Async scheduling: `schedule()` may run again before the previous step's `update_from_output()` (the engine
overlaps the host's scheduling with the device's step). A request whose token is still in flight counts
it as known (one more decode token to schedule, its input read from the previous step's output on the
device) unless that token would reach max_tokens or max_model_len; a request that turns out to have
stopped is dropped when its results arrive, its extra step discarded.

Speculative decoding (jaxllm/spec_decode/): a running request may hold proposed tokens
(`Request.spec_token_ids`, set by the engine between steps). In a step where every running request is
decoding and none waits, such a request gets 1 + k tokens (its last token and k proposals, k trimmed to
the budget, max_tokens and max_model_len) and its ScheduledRequest carries them; proposals are consumed
(or dropped) by every schedule(). The results then bring 1..k+1 tokens; the proposals' KV past the first
rejected one is discarded by moving num_computed_tokens back (those slots are written again later).
Speculation needs the results of the step before (its proposals read them), so such steps are not
overlapped: the engine schedules them one at a time.

Swap pairs are (device block, host block) in both directions. The runner must copy blocks_to_swap_out
before the step's forward pass (their device blocks are free again and may be written this step), then
blocks_to_swap_in.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager, cdiv
from jaxllm.core.memory_report import KVMemoryReport
from jaxllm.request import Request, RequestStatus
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxllm.stats import EngineStats


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks} must be >= 0")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(self.block_size, num_gpu_blocks, cache_config.enable_prefix_caching)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self._free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._swapped: dict[str, list[int]] = {}  # request id -> host blocks holding its KV, in order

        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # queue order: front first
        self.running: list[Request] = []  # admission order: most recent last
        self._finished_ids: list[str] = []  # finished since the last schedule(): the runner drops them
        self._finished_in_schedule: list[Request] = []  # reported by the next update_from_output
        # id(SchedulerOutput) -> the Requests it scheduled, in its order, until update_from_output applies it
        self._scheduled_requests: dict[int, list[Request]] = {}

        self._num_preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # speculative decoding: steps that verified proposals, tokens proposed, accepted (also by position)
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        self._spec_accepted_per_pos: list[int] = []

    # -- requests in and out ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the scheduler")
        n = request.num_prompt_tokens
        if n < 1:
            raise ValueError("prompt_token_ids must hold at least one token")
        if n > self.config.max_model_len:
            raise ValueError(f"prompt length {n} exceeds max_model_len={self.config.max_model_len}")
        if cdiv(n, self.block_size) > self.kv.pool.num_usable_blocks:
            raise ValueError(
                f"prompt length {n} needs {cdiv(n, self.block_size)} KV blocks; the cache holds "
                f"{self.kv.pool.num_usable_blocks}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request (finished ones are dropped; update_from_output returns them once)."""
        return self.requests.get(request_id)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, or a stop string found by the detokenizer)."""
        if not status.finished:
            raise ValueError(f"status={status!r} must be a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._dequeue(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        # request id -> (request, its delta, its NewRequestData or None when the runner holds it)
        scheduled: dict[str, tuple[Request, ScheduledRequest, NewRequestData | None]] = {}
        preempted = False

        # 1. Running requests: decodes (one remaining token) before prompt chunks; sort is stable.
        running = RequestStatus.RUNNING
        ordered = sorted(self.running, key=_more_than_one_uncomputed)
        # proposals only in a step of decodes alone: nothing waits, and the last in order is a decode too
        speculate = not self.waiting and not (ordered and _more_than_one_uncomputed(ordered[-1]))
        for request in ordered:
            if budget == 0:
                break
            if request.status != running:  # preempted earlier in this loop
                continue
            if request.num_output_placeholders and self._pending_token_ends(request):
                continue  # its token in flight is its last: it finishes when the result arrives
            num_new = min(_num_uncomputed(request), budget)
            if num_new <= 0:
                continue
            spec = self._spec_tokens(request, budget) if speculate and request.spec_token_ids else []
            num_new += len(spec)
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                if victim is request and len(self.running) == 1:
                    # Nothing else holds blocks: the pool cannot hold this sequence's next token.
                    self.running.remove(request)
                    self._finish(request, RequestStatus.FINISHED_LENGTH)
                    self._finished_in_schedule.append(request)
                    break
                self._preempt(victim, out)
                preempted = True
                if victim.request_id in scheduled:  # it was given tokens earlier in this loop
                    budget += scheduled.pop(victim.request_id)[1].num_new_tokens
                if victim is request:
                    break
            if request.status != running:
                continue
            delta = self._delta(request, num_new, [b.block_id for b in new_blocks] if new_blocks else [])
            delta.spec_token_ids = spec
            scheduled[request.request_id] = (request, delta, None)
            budget -= num_new
        for request in self.running:  # proposals are for this step only
            request.spec_token_ids = []

        # 2. Waiting requests, unless memory was short this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.SWAPPED:
                num_new = self._swap_in(request, budget, out)
            else:
                num_new = self._admit(request, budget)
            if num_new == 0:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            # New to the runner (a preemption dropped its state there too): sent whole, once.
            scheduled[request.request_id] = (
                request,
                self._delta(request, num_new, []),
                self._new_data(request),
            )
            budget -= num_new

        # Decodes first in the output, then prompt chunks, each group in scheduling order.
        order = sorted(scheduled.values(), key=lambda e: e[1].num_new_tokens > 1 or not e[1].samples)
        requests = [e[0] for e in order]
        out.scheduled = [e[1] for e in order]
        out.new_requests = [e[2] for e in order if e[2] is not None]
        num_tokens = 0
        for request, s in zip(requests, out.scheduled):
            n = s.num_new_tokens
            num_tokens += n
            p = request.num_prompt_tokens
            if s.start < p:
                self._prompt_tokens += min(s.start + n, p) - s.start
            request.num_computed_tokens += n
            if s.samples:
                request.num_output_placeholders += 1
        out.num_scheduled_tokens = num_tokens
        if requests:
            self._scheduled_requests[id(out)] = requests
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results; returns the requests that got new tokens or finished."""
        if len(runner_out.sampled_token_ids) != len(sched_out.scheduled):
            raise ValueError(
                f"runner returned {len(runner_out.sampled_token_ids)} results for "
                f"{len(sched_out.scheduled)} scheduled requests"
            )
        requests = self._scheduled_requests.pop(id(sched_out), None) if sched_out.scheduled else []
        if requests is None:
            raise ValueError("sched_out: not an output of this scheduler's schedule(), or applied already")
        changed, self._finished_in_schedule = self._finished_in_schedule, []
        req_ids = runner_out.req_ids
        for i, (request, s) in enumerate(zip(requests, sched_out.scheduled)):
            if req_ids:
                assert req_ids[i] == request.request_id, (req_ids[i], request.request_id)
            if s.samples and request.num_output_placeholders > 0:
                request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # finished from outside (abort, stop string) or by an earlier result
            new_tokens = runner_out.sampled_token_ids[i]
            if s.spec_token_ids:
                self._apply_verification(request, s, len(new_tokens))
            # A request preempted after this step was scheduled still gets its token: the step ran.
            status = None
            for j, token in enumerate(new_tokens):
                request.output_token_ids.append(token)
                self._generation_tokens += 1
                status = self._check_stop(request, token)
                if status is not None:
                    if j + 1 < len(new_tokens):  # accepted tokens past a stop are not output
                        runner_out.sampled_token_ids[i] = new_tokens[: j + 1]
                    break
            if request.status == RequestStatus.RUNNING:
                self.kv.cache_blocks(request)
            if status is not None:
                self._dequeue(request)
                self._finish(request, status)
            if new_tokens or status is not None:
                changed.append(request)
        return changed

    # -- stats -----------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting) - len(self._swapped),  # swapped requests wait too
            num_requests_swapped=len(self._swapped),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            spec_decode_num_drafts=self._spec_drafts,
            spec_decode_num_draft_tokens=self._spec_draft_tokens,
            spec_decode_num_accepted_tokens=self._spec_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self._spec_accepted_per_pos),
        )

    def kv_memory_report(self) -> KVMemoryReport:
        """Filled / allocated KV slots of the running requests (call between steps)."""
        return self.kv.memory_report(self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (nothing done) while any request holds blocks."""
        return self.kv.pool.reset_prefix_cache()

    @property
    def max_kv_tokens(self) -> int:
        """Tokens the whole device KV cache holds (every usable block): a request whose prompt + max_tokens
        exceed it could never finish, however long it waited or whatever was preempted for it."""
        return self.kv.pool.num_usable_blocks * self.block_size

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._free_cpu_blocks)

    # -- internals -------------------------------------------------------------------------------------
    def _queue_key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=self._queue_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _delta(self, request: Request, num_new: int, new_block_ids: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        known = request.num_tokens + request.num_output_placeholders
        return ScheduledRequest(request.request_id, num_new, start, new_block_ids, start + num_new >= known)

    def _spec_tokens(self, request: Request, budget: int) -> list[int]:
        """The request's proposals this step may verify: as many as fit the budget beside its own token,
        and leave room for the token sampled after the last one (max_tokens, max_model_len)."""
        if request.num_output_placeholders:  # proposals follow the last token known on the host
            return []
        k = min(
            len(request.spec_token_ids),
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return request.spec_token_ids[:k] if k > 0 else []

    def _apply_verification(self, request: Request, s: ScheduledRequest, num_new_tokens: int) -> None:
        """A step verified `s.spec_token_ids` and returned `num_new_tokens` (the accepted ones and one
        more): count them, and forget the KV of the rejected ones (computed, but not the request's)."""
        k = len(s.spec_token_ids)
        accepted = max(0, num_new_tokens - 1)
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= k - accepted
        request.spec_num_draft_tokens += k
        request.spec_num_accepted_tokens += accepted
        self._spec_drafts += 1
        self._spec_draft_tokens += k
        self._spec_accepted_tokens += accepted
        per_pos = self._spec_accepted_per_pos
        if len(per_pos) < k:
            per_pos.extend([0] * (k - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def _new_data(self, request: Request) -> NewRequestData:
        """What the runner needs of a request it does not hold (new, or resumed after a preemption)."""
        # Admitted only from the waiting queue, by then every step that ran for it has been applied (a
        # preemption skips admission in its own schedule()): no token of it is still in flight.
        assert request.num_output_placeholders == 0, request.request_id
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            sampling_seed=request.sampling_seed,
            eos_token_id=request.eos_token_id,
            block_ids=self.kv.get_block_ids(request),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
        )

    def _admit(self, request: Request, budget: int) -> int:
        """Give a new or preempted request blocks for its first chunk; 0 when it cannot run now."""
        assert request.num_computed_tokens == 0
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if not self.config.enable_chunked_prefill and num_new > budget:
            return 0
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
            return 0
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        return num_new

    def _swap_in(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Bring a swapped request's KV back to the device and room for its next tokens; 0 if short."""
        host_blocks = self._swapped[request.request_id]
        num_new = _num_uncomputed(request)
        if not self.config.enable_chunked_prefill and num_new > budget:
            return 0
        num_new = min(num_new, budget)
        need = cdiv(request.num_computed_tokens + num_new, self.block_size)
        if need > self.kv.num_free_blocks:
            return 0
        device_blocks = self.kv.allocate_blocks(request, len(host_blocks))
        assert device_blocks is not None
        new = self.kv.allocate_slots(request, num_new)
        assert new is not None
        out.blocks_to_swap_in.extend((d.block_id, h) for d, h in zip(device_blocks, host_blocks, strict=True))
        del self._swapped[request.request_id]
        self._free_cpu_blocks.extend(reversed(host_blocks))
        return num_new

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=self._queue_key)
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device: to host memory if there is room, else to recompute."""
        self.running.remove(request)
        request.spec_token_ids = []  # made for the tokens it had; it proposes again when it runs
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        if 0 < num_blocks <= len(self._free_cpu_blocks):
            device_ids = self.kv.get_block_ids(request)[:num_blocks]
            host_ids = [self._free_cpu_blocks.pop() for _ in range(num_blocks)]
            out.blocks_to_swap_out.extend(zip(device_ids, host_ids, strict=True))
            self._swapped[request.request_id] = host_ids
            request.status = RequestStatus.SWAPPED
        else:
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        self.kv.free(request)
        request.num_preemptions += 1
        self._num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        self._enqueue(request, front=True)

    def _pending_token_ends(self, request: Request) -> bool:
        """The tokens in flight bring the request to max_tokens or max_model_len: schedule it no further."""
        pending = request.num_output_placeholders
        return (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.config.max_model_len
        )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _dequeue(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (preempted ones wait while a result is due)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished (the caller took it out of its queue) and release its device and host blocks."""
        request.status = status
        self.kv.free(request)
        host_blocks = self._swapped.pop(request.request_id, None)
        if host_blocks:
            self._free_cpu_blocks.extend(reversed(host_blocks))
        self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]


def _num_uncomputed(request: Request) -> int:
    """Tokens the request has (its placeholders in flight included) whose KV is not computed yet."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def _more_than_one_uncomputed(request: Request) -> bool:
    """The sort key that puts decodes (one uncomputed token) before prompt chunks."""
    return _num_uncomputed(request) > 1
