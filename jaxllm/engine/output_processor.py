"""Turn per-step request updates into user-facing `RequestOutput`s.

For each request updated by a step: detokenize the new tokens incrementally, look for stop strings (the
engine finishes the request when one is found), convert logprobs, and assemble the cumulative
`RequestOutput` of its parent (a parent has `n` child requests, one per sample). While a request runs, text
that could still grow into a stop string is held back from `outputs[i].text`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, stop_holdback_len
from jaxllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from jaxllm.request import Request
from jaxllm.runner_output import TokenLogprobs


@dataclass(eq=False)
class ChildState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    stopped_text: str | None = None  # final text once a stop string was found
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    num_emitted_tokens: int = 0


@dataclass(eq=False)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    extra: dict = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}

    def add(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for c in parent.children:
            self.child_to_parent[c.request.request_id] = (parent, c)

    def _decode_one(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else None

    def _to_position_logprobs(self, lp: TokenLogprobs, row: int) -> PositionLogprobs:
        d: PositionLogprobs = {}
        for j in range(lp.token_ids.shape[1]):
            tid = int(lp.token_ids[row, j])
            if tid in d:
                continue
            d[tid] = Logprob(float(lp.logprobs[row, j]), int(lp.ranks[row, j]), self._decode_one(tid))
        return d

    def on_prompt_logprobs(self, child_id: str, lp: TokenLogprobs) -> None:
        parent, child = self.child_to_parent[child_id]
        if child.index != 0:
            return
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no prefix to be predicted from
        for r in range(lp.token_ids.shape[0]):
            parent.prompt_logprobs.append(self._to_position_logprobs(lp, r))

    def on_tokens(self, req: Request, new_token_ids: list[int], lp: TokenLogprobs | None) -> str | None:
        """Record new tokens of a child; returns the stop string if one was found (engine finishes it)."""
        parent, child = self.child_to_parent[req.request_id]
        now = time.monotonic()
        if parent.metrics.first_token_time is None and new_token_ids:
            parent.metrics.first_token_time = now
        if new_token_ids:
            parent.metrics.last_token_time = now
        if lp is not None and req.sampling_params.logprobs is not None:
            if child.logprobs is None:
                child.logprobs = []
                child.cumulative_logprob = 0.0
            for r in range(lp.token_ids.shape[0]):
                child.logprobs.append(self._to_position_logprobs(lp, r))
                child.cumulative_logprob += float(lp.logprobs[r, 0])
        if child.detok is None or child.stopped_text is not None:
            return None
        params = req.sampling_params
        for tid in new_token_ids:
            delta = child.detok.step([tid])
            if not delta:
                continue
            child.text += delta
            if params.stop_list:
                stop, truncated = check_stop_strings(
                    child.text, len(delta), params.stop_list, params.include_stop_str_in_output
                )
                if stop is not None:
                    child.stopped_text = truncated
                    child.text = truncated
                    return stop
        return None

    def make_output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        outs = []
        for c in parent.children:
            r = c.request
            done = r.is_finished
            text = c.text
            if not done and c.detok is not None and r.sampling_params.stop_list:
                hold = stop_holdback_len(text, r.sampling_params.stop_list)
                text = text[: len(text) - hold] if hold else text
            if done and c.detok is not None and c.stopped_text is None:
                c.text += c.detok.flush()
                text = c.text
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        finished = all(c.request.is_finished for c in parent.children)
        if finished and not parent.finished:
            parent.finished = True
            parent.metrics.finished_time = time.monotonic()
        cached = max(0, parent.children[0].request.num_cached_tokens)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=cached,
            metrics=parent.metrics,
        )

    def remove(self, parent_id: str) -> None:
        parent = self.parents.pop(parent_id, None)
        if parent is not None:
            for c in parent.children:
                self.child_to_parent.pop(c.request.request_id, None)
