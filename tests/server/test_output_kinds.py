"""The server asks the engine for DELTA outputs when it streams and FINAL_ONLY otherwise; the mock engine
yields for each kind what the engine's output processor yields (it runs it), and the request metrics
(TTFT, inter-token latency) count the same tokens whatever the kind."""

from __future__ import annotations

import asyncio
import re

from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from tests.server.mock_engine import MockAsyncEngine


def _generate_all_kinds(params: SamplingParams, prompt: str):
    async def run():
        engine = MockAsyncEngine(step_delay_s=0.0)
        await engine.start()
        got = {}
        for kind in RequestOutputKind:
            got[kind] = [o async for o in engine.generate(prompt, params.clone(output_kind=kind), kind.name)]
        return engine, got

    return asyncio.run(run())


def test_mock_outputs_follow_the_kind_and_hold_back_stop_strings():
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=1)
    engine, free = _generate_all_kinds(params, "hello world the cat")
    text0 = free[RequestOutputKind.CUMULATIVE][-1].outputs[0].text
    words = text0.split()
    stop = words[5] + " " + words[6][:2] + "#"  # a stop string the text starts but never completes
    params = params.clone(stop=[stop, " ".join(words[9:11])])
    engine, got = _generate_all_kinds(params, "hello world the cat")
    cum, delta, final = (got[k] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].outputs == cum[-1].outputs
    assert len(delta) == len(cum) and delta[-1].finished
    tok = engine.tokenizer
    for o in cum[-1].outputs:
        parts = [d for out in delta for d in out.outputs if d.index == o.index]
        assert "".join(d.text for d in parts) == o.text
        assert [t for d in parts for t in d.token_ids] == o.token_ids
        assert [x for d in parts for x in d.logprobs] == o.logprobs
        assert [d.finish_reason for d in parts if d.finish_reason] == [o.finish_reason]
    held = 0
    for k, out in enumerate(cum):  # sample 0's text at each step: decoded, cut, the possible stop start held
        o = out.outputs[0]
        full = tok.decode(o.token_ids, skip_special_tokens=True)
        hits = [full.find(s) for s in params.stop_list if s in full]
        if hits:
            expected = full[: min(hits)]
        elif o.finish_reason is not None:
            expected = full
        else:
            hold = max(
                [j for s in params.stop_list for j in range(1, len(s)) if full.endswith(s[:j])], default=0
            )
            expected = full[: len(full) - hold]
        assert o.text == expected, k
        held += expected != full
    assert held >= 1


def _hist_count(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}_count\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _successes(text: str, reason: str) -> float:
    m = re.search(rf'^jaxllm:request_success_total\{{finished_reason="{reason}",[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_request_metrics_count_tokens_and_choices_for_streamed_and_single_responses(client):
    names = [
        "jaxllm:time_to_first_token_seconds",
        "jaxllm:inter_token_latency_seconds",
        "jaxllm:e2e_request_latency_seconds",
    ]
    for stream in (False, True):
        before = client.get("/metrics").text
        body = {"prompt": "hello world", "max_tokens": 5, "ignore_eos": True, "n": 2, "stream": stream}
        assert client.post("/v1/completions", json=body).status_code == 200
        after = client.get("/metrics").text
        counts = [_hist_count(after, n) - _hist_count(before, n) for n in names]
        assert counts == [1, 4, 1], (stream, counts)  # first token once, then one per later token
        assert _successes(after, "length") - _successes(before, "length") == 2  # one per choice


def test_server_asks_for_delta_when_streaming_and_final_only_otherwise(client, engine, monkeypatch):
    kinds = []
    real = engine.generate

    def spy(prompt, params, request_id, *, priority=0):
        kinds.append(params.output_kind)
        return real(prompt, params, request_id, priority=priority)

    monkeypatch.setattr(engine, "generate", spy)
    for stream in (False, True):
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": stream})
        msgs = [{"role": "user", "content": "hello"}]
        client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "stream": stream})
    F, D = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA
    assert kinds == [F, F, D, D]


def test_request_success_counts_every_choice_when_they_end_at_different_steps(client):
    base = {"prompt": "hello world", "max_tokens": 10, "n": 2, "temperature": 1.0, "logprobs": 0}
    for seed in range(50):  # a seed whose two samples end after different numbers of tokens
        r = client.post("/v1/completions", json={**base, "seed": seed}).json()
        lengths = [len(c["logprobs"]["tokens"]) for c in r["choices"]]
        if lengths[0] != lengths[1]:
            break
    else:
        raise AssertionError("no seed gives samples of different lengths")
    reasons = [c["finish_reason"] for c in r["choices"]]
    before = client.get("/metrics").text
    assert client.post("/v1/completions", json={**base, "seed": seed, "stream": True}).status_code == 200
    after = client.get("/metrics").text
    for reason in set(reasons):
        assert _successes(after, reason) - _successes(before, reason) == reasons.count(reason), reason


def test_sse_bytes_are_those_of_the_diffing_server(client, monkeypatch):
    """Streams made from the engine's deltas are byte-for-byte what the server sent when it diffed
    cumulative outputs, on the same tokens (recorded: completions and chat, n > 1, logprobs, echo, stop
    strings with and without include_stop_str_in_output, min_tokens, usage)."""
    import json
    import os
    import uuid

    class FixedId:
        hex = "0" * 32

    monkeypatch.setattr(uuid, "uuid4", FixedId)
    path = os.path.join(os.path.dirname(__file__), "data", "sse_before_deltas.json")
    with open(path, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    assert len(cases) >= 10
    for case in cases:
        r = client.post(case["route"], json=case["body"])
        assert r.status_code == 200
        assert re.sub(r'"created":\d+', '"created":0', r.text) == case["sse"], case["body"]
