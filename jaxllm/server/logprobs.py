"""Engine logprobs (`list[dict[token_id, Logprob]]`, one dict per generated position) -> OpenAI's shapes.

Chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
Completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}
Prompt logprobs (vLLM): [None, {token_id: {"logprob", "rank", "decoded_token"}}, ...], one per prompt token.
Each call formats a slice of positions, so streaming sends only the positions new in a chunk.
"""

from __future__ import annotations

import math

from jaxllm.outputs import Logprob, PositionLogprobs


def _finite(x: float) -> float:
    # JSON has no -inf; vLLM clamps the same way.
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def token_text(tokenizer, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def _top(position: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda x: x[1].rank)
    return ranked[:num]


def chat_logprobs(
    tokenizer, token_ids: list[int], positions: list[PositionLogprobs] | None, top_n: int
) -> dict:
    content = []
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else {}
        lp = position.get(tid)
        tok = token_text(tokenizer, tid, lp)
        top = []
        for t, tlp in _top(position, top_n):
            s = token_text(tokenizer, t, tlp)
            top.append({"token": s, "logprob": _finite(tlp.logprob), "bytes": list(s.encode("utf-8"))})
        content.append(
            {
                "token": tok,
                "logprob": _finite(lp.logprob) if lp is not None else -9999.0,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    positions: list[PositionLogprobs | None] | None,
    top_n: int,
    text_offset: int = 0,
) -> dict:
    """`positions[i]` may be None (the first prompt token when echoing has no logprob)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        lp = position.get(tid) if position is not None else None
        tok = token_text(tokenizer, tid, lp)
        out["tokens"].append(tok)
        out["text_offset"].append(offset)
        offset += len(tok)
        if position is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(lp.logprob) if lp is not None else None)
        top = {token_text(tokenizer, t, tlp): _finite(tlp.logprob) for t, tlp in _top(position, top_n)}
        if lp is not None:
            top.setdefault(tok, _finite(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs_json(
    tokenizer, prompt_ids: list[int], positions: list[PositionLogprobs | None] | None, top_n: int
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: one entry per prompt token, None for the first (nothing predicts it),
    then {token id: {"logprob", "rank", "decoded_token"}} holding the prompt's own token and the top-N."""
    out: list[dict | None] = []
    for i, tid in enumerate(prompt_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        if position is None:
            out.append(None)
            continue
        keep = [
            (t, lp) for t, lp in position.items() if t == tid or (lp.rank is not None and lp.rank <= top_n)
        ]
        out.append(
            {
                str(t): {
                    "logprob": _finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": token_text(tokenizer, t, lp),
                }
                for t, lp in keep
            }
        )
    return out
