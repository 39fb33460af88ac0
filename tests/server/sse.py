"""Parsing an SSE body into its JSON chunks (and checking it ends with `data: [DONE]`)."""

from __future__ import annotations

import json


def parse_sse(text: str) -> list[dict]:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events, "empty stream"
    assert events[-1] == "data: [DONE]", events[-1]
    out = []
    for e in events[:-1]:
        assert e.startswith("data: "), e
        out.append(json.loads(e[len("data: ") :]))
    return out


def stream_texts(chunks: list[dict], chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            piece = ch["delta"].get("content") if chat else ch["text"]
            texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts


def finish_reasons(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"] is not None:
                assert ch["index"] not in out, "finish_reason sent twice"
                out[ch["index"]] = ch["finish_reason"]
    return out


def streams_and_non_streamed(url: str, prompt_of, n: int, max_tokens: int, top2: list | None = None):
    """Sends n greedy requests (even i: chat, odd i: completions) non-streamed, then the same n streamed,
    all at once each time; returns (expected, got): per request the text and finish reason. With `top2`
    (a list), the non-streamed requests also ask for 2 logprobs and top2[i] gets, per generated token,
    (token text, logprob gap between the best and second-best token)."""
    import asyncio

    import httpx

    async def phase(stream: bool):
        # A client per phase: a keep-alive connection left idle by the first phase past the server's
        # keep-alive timeout (uvicorn's 5 s, vLLM's too) can be closed by the server just as the second
        # phase sends on it, which the client sees as a ReadError that no server fault caused.
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as c:

            async def one(i: int, stream: bool):
                chat = i % 2 == 0
                body = {"temperature": 0, "max_tokens": max_tokens, "stream": stream}
                if top2 is not None and not stream:
                    body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
                if chat:
                    body["messages"] = [{"role": "user", "content": prompt_of(i)}]
                else:
                    body["prompt"] = prompt_of(i)
                route = "/v1/chat/completions" if chat else "/v1/completions"
                if not stream:
                    r = await c.post(route, json=body)
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    if top2 is not None:
                        top2[i] = _top2_gaps(ch["logprobs"], chat)
                    return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
                async with c.stream("POST", route, json=body) as r:
                    assert r.status_code == 200
                    raw = "".join([part async for part in r.aiter_text()])
                chunks = parse_sse(raw)  # also checks the stream ends with data: [DONE]
                return stream_texts(chunks, chat)[0], finish_reasons(chunks)[0]

            return await asyncio.gather(*(one(i, stream) for i in range(n)))

    async def run():
        if top2 is not None:
            top2[:] = [None] * n
        return await phase(False), await phase(True)

    return asyncio.run(run())


def _top2_gaps(logprobs: dict, chat: bool) -> list[tuple[str, float]]:
    if chat:
        return [(e["token"], _gap([t["logprob"] for t in e["top_logprobs"]])) for e in logprobs["content"]]
    return [(tok, _gap(list(top.values()))) for tok, top in zip(logprobs["tokens"], logprobs["top_logprobs"])]


def _gap(lps: list[float]) -> float:
    lps = sorted(lps, reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def first_difference_is_a_near_tie(
    expected: str, got: str, gaps: list[tuple[str, float]], tol: float
) -> bool:
    """Where two greedy texts part, was the expected run's choice a near-tie (top-2 gap < tol)? Rounding
    that depends on the batch's shape may flip such a choice; anything else is a real difference."""
    k = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    pos = 0
    for token, gap in gaps:
        end = pos + len(token)
        if k < end or (k == end and k == len(expected)):
            return gap < tol
        if k == end:  # the difference starts exactly at the next token
            pos = end
            continue
        pos = end
    return False
