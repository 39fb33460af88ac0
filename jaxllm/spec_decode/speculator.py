"""Which running requests get proposals before a step, and when speculation stops paying for a request.

The engine calls `propose(running)` before each schedule() whose previous step's results are all in:
every eligible request that is decoding gets proposals as `Request.spec_token_ids`, which the scheduler
verifies in the step: the n-gram proposals of its tokens (ngram.py), or what the draft model decodes
from them (draft_model.py, one batch for all such requests).

Eligible: requests whose next-token distribution depends only on the prefix, so that one forward pass
gives it at every proposed position: no penalties (they read the whole history), no token rules (a
grammar or bad words would have to advance through each proposal), no research (captures and edits are
per step). Others decode one token per step in the same batches.

Batch size: proposals pay where a step is bound by reading the weights, which a few more tokens per
sequence do not change; in a large batch the step's tokens reach the GEMMs' compute bound, and the
all-rows logits of a verification step grow with them. So no request gets proposals while more run than
`max_speculating_requests` (at most VERIFY_TOKENS tokens per verification step, and the config's
`disable_by_batch_size`), and such steps overlap as without speculation.

Switching itself off: a step that verifies proposals cannot be scheduled while the step before it runs
(its proposals read that step's tokens), so speculation costs the overlap of host and device work, and
a verified proposal costs a position of the forward pass. A request that, after SWITCH_OFF_AFTER
decoding steps, gained fewer than MIN_GAIN_PER_STEP accepted tokens per step (text without repeats, where
prompt lookup finds nothing or guesses wrong) gets no more proposals; once no running request is
eligible, the engine overlaps steps again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllm.config import SpeculativeConfig
from jaxllm.request import Request
from jaxllm.spec_decode.ngram import TokenHistory, propose_ngram

if TYPE_CHECKING:
    from jaxllm.spec_decode.draft_model import DraftModelProposer

SWITCH_OFF_AFTER = 16  # decoding steps a request speculates before its gain is judged
MIN_GAIN_PER_STEP = 0.25  # accepted tokens per decoding step below which it stops
VERIFY_TOKENS = 256  # the most tokens of a step that verifies proposals (its all-rows logits: [T, V])


def max_speculating_requests(config: SpeculativeConfig) -> int:
    """The most running requests with which proposals are still made."""
    most = max(1, VERIFY_TOKENS // (1 + config.num_speculative_tokens))
    if config.disable_by_batch_size is not None:
        most = min(most, config.disable_by_batch_size - 1)
    return most


def max_verification_tokens(config: SpeculativeConfig, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most tokens a step that verifies proposals can hold (what is compiled ahead for them)."""
    seqs = min(max_num_seqs, max_speculating_requests(config))
    return max(1, min(max_num_batched_tokens, seqs * (1 + config.num_speculative_tokens)))


def eligible(request: Request) -> bool:
    p = request.sampling_params
    return not p.uses_penalties and not p.constrains_tokens and p.research is None


class _RequestSpeculation:
    __slots__ = ("history", "steps", "on")

    def __init__(self) -> None:
        self.history: TokenHistory | None = None  # prompt lookup's copy of the tokens, made on first use
        self.steps = 0  # decoding steps since it became eligible
        self.on = True


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative method {config.method!r} with draft={draft!r}")
        self.config = config
        self.draft = draft
        self.max_requests = max_speculating_requests(config)
        self._states: dict[str, _RequestSpeculation] = {}

    def speculating(self, running: list[Request]) -> bool:
        """Whether any running request would get proposals (the engine then schedules one step at a time)."""
        if len(running) > self.max_requests:
            return False
        states = self._states
        for r in running:
            if eligible(r):
                st = states.get(r.request_id)
                if st is None or st.on:
                    return True
        return False

    def propose(self, running: list[Request]) -> int:
        """Set the proposals of each eligible decoding request (none while more than `max_requests` run);
        returns how many requests got some. States of requests no longer running are dropped."""
        cfg = self.config
        old, states = self._states, {}
        self._states = states
        wanting: list[tuple[Request, _RequestSpeculation]] = []
        switched_off: list[str] = []
        if len(running) <= self.max_requests:  # (each schedule() drops the proposals it was given)
            for r in running:
                if not eligible(r):
                    continue
                st = states[r.request_id] = old.get(r.request_id) or _RequestSpeculation()
                if not st.on or r.num_output_placeholders or not r.output_token_ids:
                    continue
                if r.num_tokens - r.num_computed_tokens != 1:  # not decoding (a prompt chunk is left)
                    continue
                st.steps += 1
                judged = st.steps - 1  # steps whose results are in
                if judged >= SWITCH_OFF_AFTER and r.spec_num_accepted_tokens < MIN_GAIN_PER_STEP * judged:
                    st.on = False
                    switched_off.append(r.request_id)
                    continue
                wanting.append((r, st))
        if self.draft is not None:
            # the draft holds the requests that were on: those gone since, and those switched off now
            self.draft.forget([rid for rid, st in old.items() if st.on and rid not in states] + switched_off)
            proposals = self.draft.propose([r for r, _ in wanting]) if wanting else {}
            for r, _ in wanting:
                r.spec_token_ids = proposals.get(r.request_id, [])
        else:
            for r, st in wanting:
                if st.history is None:
                    st.history = TokenHistory()
                tokens = st.history.sync(r.prompt_token_ids, r.output_token_ids)
                r.spec_token_ids = propose_ngram(
                    tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens
                )
        return sum(bool(r.spec_token_ids) for r, _ in wanting)
