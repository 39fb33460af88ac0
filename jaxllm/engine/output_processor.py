"""Turn per-step request updates into user-facing `RequestOutput`s, built as each request's kind asks.

For each request a step updated, `on_tokens` detokenizes the new tokens incrementally, looks for stop
strings (the engine finishes the request when one is found) and converts logprobs; `make_output` then
assembles the output of its parent (a parent has `n` child requests, one per sample) for the parent's
`SamplingParams.output_kind`:

    CUMULATIVE  the whole text and copies of all token ids and logprobs, every step (the kind's own cost)
    DELTA       the text released, the token ids and the logprob positions added since the last output
    FINAL_ONLY  nothing until every child has finished, then everything, once

Text is released, never taken back. While a request runs, decoded text that could still grow into a stop
string is held (`ChildState.held`, at most the longest stop string's length minus one) until it can't;
released text waits in `ChildState.pieces` for the parent's next output. When the request ends (length,
stop token, abort) the held text and whatever the detokenizer still holds are released; a stop string
cuts the text where it starts (or ends, with include_stop_str_in_output) and nothing follows. A stop
string can only start in held text, so the checks look at the held text and the new text, never the
whole: per step, a DELTA or FINAL_ONLY request costs its new tokens, not its whole output.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from jaxllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, stop_holdback_len
from jaxllm.outputs import (
    Captures,
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from jaxllm.request import Request, RequestStatus
from jaxllm.runner_output import TokenLogprobs
from jaxllm.sampling_params import RequestOutputKind

_CUMULATIVE = RequestOutputKind.CUMULATIVE
_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass(eq=False, slots=True)
class ChildState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    held: str = ""  # decoded text that may still turn out to start a stop string: not released yet
    pieces: list[str] = field(default_factory=list)  # released text not in an output yet
    text: str = ""  # CUMULATIVE: all text released so far
    text_done: bool = False  # no more text: a stop string cut it, or the request ended (all released)
    logprobs: list[PositionLogprobs] | None = None  # DELTA: positions not in an output yet; else all
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # DELTA: how many output token ids are already in an output
    finish_sent: bool = False  # an output has carried its finish reason
    # research: site name -> position -> activation row (a recomputed position, after a preemption,
    # replaces its equal row); None when the request captures nothing
    captures: dict[str, dict[int, np.ndarray]] | None = None
    unsent_positions: list[int] = field(default_factory=list)  # DELTA: captured, not in an output yet


@dataclass(eq=False, slots=True)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    kind: RequestOutputKind = _CUMULATIVE  # set by OutputProcessor.add from the children's params
    stop_window: int = 0  # the longest stop string's length - 1: how far back a stop can start (add)
    num_outputs: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}

    def add(self, parent: ParentState) -> None:
        params = parent.children[0].request.sampling_params
        parent.kind = params.output_kind
        parent.stop_window = max(map(len, params.stop_list), default=1) - 1
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
        if new_token_ids:
            now = time.monotonic()
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
        if req.spec_num_draft_tokens:
            m = parent.metrics
            m.spec_num_draft_tokens = sum(c.request.spec_num_draft_tokens for c in parent.children)
            m.spec_num_accepted_tokens = sum(c.request.spec_num_accepted_tokens for c in parent.children)
        params = req.sampling_params
        if lp is not None and params.logprobs is not None:
            if child.logprobs is None:
                child.logprobs = []
                child.cumulative_logprob = 0.0
            for r in range(lp.token_ids.shape[0]):
                child.logprobs.append(self._to_position_logprobs(lp, r))
                child.cumulative_logprob += float(lp.logprobs[r, 0])
        if child.detok is None or child.text_done:
            return None
        if (
            new_token_ids
            and req.status == RequestStatus.FINISHED_STOPPED
            and not params.include_stop_str_in_output
        ):
            # The scheduler stopped it on this step's last token (EOS or a stop token id): as in vLLM, that
            # token stays in token_ids but adds no text (with skip_special_tokens=False it would show).
            new_token_ids = new_token_ids[:-1]
        stops = params.stop_list
        if not stops:
            delta = child.detok.step(new_token_ids)
            if delta:
                child.pieces.append(delta)
            return None
        # One token at a time: the earliest stop string wins, and the tokens after it add no text.
        text = child.held
        for tid in new_token_ids:
            delta = child.detok.step([tid])
            if not delta:
                continue
            text += delta
            stop, truncated = check_stop_strings(text, len(delta), stops, params.include_stop_str_in_output)
            if stop is not None:
                child.held = ""
                child.text_done = True
                if truncated:
                    child.pieces.append(truncated)
                return stop
        if parent.kind is _FINAL_ONLY:
            # Nothing is shown before the end, so nothing need be held exactly: keep a window that a stop
            # string could still start in, and move the text before it on now and then.
            keep = parent.stop_window
            if len(text) > 2 * keep + 64:
                child.pieces.append(text[: len(text) - keep])
                text = text[len(text) - keep :]
            child.held = text
            return None
        hold = stop_holdback_len(text, stops)
        if hold < len(text):
            child.pieces.append(text[: len(text) - hold])
        child.held = text[len(text) - hold :] if hold else ""
        return None

    @staticmethod
    def _end_text(child: ChildState) -> None:
        """The request ended without a stop string: release the held text and the detokenizer's rest."""
        child.text_done = True
        if child.detok is None:
            return
        tail = child.held + child.detok.flush()
        child.held = ""
        if tail:
            child.pieces.append(tail)

    def on_captures(self, child_id: str, captures: dict[str, tuple[list[int], np.ndarray]]) -> None:
        """One step's captures of a child: per site, (positions, rows)."""
        _, child = self.child_to_parent[child_id]
        if child.captures is None:
            child.captures = {}
        for i, (site, (positions, rows)) in enumerate(captures.items()):
            by_position = child.captures.setdefault(site, {})
            if i == 0:  # every site of a step captures the same positions: count the new ones once
                child.unsent_positions += [p for p in positions if p not in by_position]
            for p, row in zip(positions, rows):
                by_position[p] = row

    def make_output(self, parent: ParentState) -> RequestOutput | None:
        """The parent's output now, as its kind asks; None when the kind sends nothing now (FINAL_ONLY
        before the end). Marks the parent finished once every child has."""
        finished = True
        for c in parent.children:
            if c.request.is_finished:
                if not c.text_done:
                    self._end_text(c)
            else:
                finished = False
        kind = parent.kind
        if kind is _DELTA:
            outs = self._delta_completions(parent)
        elif kind is _CUMULATIVE:
            outs = [_cumulative_completion(c) for c in parent.children]
        elif finished:  # FINAL_ONLY: every child's only output
            outs = [_final_completion(c) for c in parent.children]
        else:
            return None
        first = parent.num_outputs == 0
        parent.num_outputs += 1
        m = parent.metrics
        if finished and not parent.finished:
            parent.finished = True
            m.finished_time = time.monotonic()
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outs,
            finished,
            parent.prompt_logprobs if first or kind is not _DELTA else None,
            max(0, parent.children[0].request.num_cached_tokens),
            dataclasses.replace(m),
        )

    @staticmethod
    def _delta_completions(parent: ParentState) -> list[CompletionOutput]:
        """What is new for each child since the parent's last output; the first output lists every child,
        later ones only the children with new tokens or an unreported end (text comes only with those)."""
        first = parent.num_outputs == 0
        outs = []
        for c in parent.children:
            r = c.request
            ids = r.output_token_ids
            num_new = len(ids) - c.num_sent_tokens
            finish = None if c.finish_sent else r.finish_reason
            if not (num_new or finish or first):
                continue
            new_ids = ids[c.num_sent_tokens :] if num_new else []
            c.num_sent_tokens = len(ids)
            text = "".join(c.pieces)
            c.pieces.clear()
            logprobs = c.logprobs
            if logprobs is not None:
                c.logprobs = []
            if finish is not None:
                c.finish_sent = True
            outs.append(
                CompletionOutput(
                    c.index,
                    text,
                    new_ids,
                    c.cumulative_logprob,
                    logprobs,
                    finish,
                    r.stop_reason,
                    _captures(c, delta=True),
                )
            )
        return outs

    def remove(self, parent_id: str) -> None:
        parent = self.parents.pop(parent_id, None)
        if parent is not None:
            for c in parent.children:
                self.child_to_parent.pop(c.request.request_id, None)


def _cumulative_completion(c: ChildState) -> CompletionOutput:
    """Everything so far: the whole text and copies of the token ids and logprobs."""
    if c.pieces:
        c.text += "".join(c.pieces)
        c.pieces.clear()
    r = c.request
    logprobs = list(c.logprobs) if c.logprobs is not None else None
    return CompletionOutput(
        c.index,
        c.text,
        list(r.output_token_ids),
        c.cumulative_logprob,
        logprobs,
        r.finish_reason,
        r.stop_reason,
        _captures(c),
    )


def _final_completion(c: ChildState) -> CompletionOutput:
    """A finished child's only output: its state is handed over, not copied (the parent is dropped)."""
    r = c.request
    return CompletionOutput(
        c.index,
        "".join(c.pieces),
        list(r.output_token_ids),
        c.cumulative_logprob,
        c.logprobs,
        r.finish_reason,
        r.stop_reason,
        _captures(c),
    )


def _captures(c: ChildState, delta: bool = False) -> Captures | None:
    """The child's captures as arrays by site, one row per position (DELTA: the positions not sent yet)."""
    if c.captures is None:
        return None
    if delta:  # the positions captured since the last output (each step's own: not the whole history)
        positions = sorted(c.unsent_positions)
        c.unsent_positions = []
    else:
        positions = sorted(set().union(*(d.keys() for d in c.captures.values())))
    arrays = {}
    for site, by_position in c.captures.items():
        if positions:
            arrays[site] = np.stack([by_position[p] for p in positions])
        else:
            first = next(iter(by_position.values()), None)
            shape, dtype = (first.shape, first.dtype) if first is not None else ((0,), np.float32)
            arrays[site] = np.zeros((0, *shape), dtype)
    return Captures(positions, arrays)
