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
