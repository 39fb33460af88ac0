"""benchmarks/structured_serving.py: its helpers on hand-made inputs, and the whole run against a real
`jaxllm serve` on the CPU (the tiny-llama preset, random weights, the byte-level tokenizer), checking the
JSON it writes: the three runs, the length-matched run's lengths, the ratios, and whether it saw its
constraints honoured, against a direct probe of the server."""

from __future__ import annotations

import json
import socket
import sys

import httpx
import pytest

from benchmarks import structured_serving as ss
from benchmarks.byte_level_tokenizer import write_byte_level_tokenizer
from benchmarks.grammar_cases import SERVING_SCHEMAS
from benchmarks.serve_metrics import RequestTiming
from benchmarks.server_process import launch_server
from benchmarks.workload import BenchRequest

PERSON = SERVING_SCHEMAS[0].schema


def timing(ttft=0.01, tokens=5, text="", finish="stop", success=True) -> RequestTiming:
    return RequestTiming(success, 8, tokens, ttft, ttft + 0.001 * tokens, text=text, finish_reason=finish)


# ---- helpers --------------------------------------------------------------------------------------------
def test_constrained_indices_and_schema_cycle():
    assert ss.constrained_indices(6, 0.5) == [1, 3, 5]
    assert ss.constrained_indices(4, 0.25) == [3]
    assert ss.constrained_indices(3, 1.0) == [0, 1, 2] and ss.constrained_indices(3, 0.0) == []
    with pytest.raises(ValueError, match="structured-fraction"):
        ss.constrained_indices(3, 1.5)
    base = [BenchRequest([i, i + 1], 2, 7) for i in range(8)]
    schemas = [PERSON, SERVING_SCHEMAS[1].schema, SERVING_SCHEMAS[2].schema]
    reqs, schema_of = ss.mixed_requests(base, schemas, 0.5, "run-x", compact=True)
    assert schema_of == {1: 0, 3: 1, 5: 2, 7: 0}
    for i, r in enumerate(reqs):
        assert (r.prompt, r.output_len) == (base[i].prompt, 7)
        if i not in schema_of:
            assert r.extra_body is None
            continue
        so = r.extra_body["structured_outputs"]
        assert r.extra_body["ignore_eos"] is False and so["disable_any_whitespace"] is True
        assert so["json"] == {**schemas[schema_of[i]], "title": "variant-run-x"}
    # The same schema twice in one run is the same text (so the second is a cache hit).
    assert reqs[1].extra_body == reqs[7].extra_body
    assert "disable_any_whitespace" not in ss.structured_body(PERSON, False)["structured_outputs"]


def test_matched_requests_take_the_mixed_runs_lengths():
    base = [BenchRequest([i], 1, 50) for i in range(4)]
    mixed = [timing(tokens=50), timing(tokens=17), timing(tokens=50), timing(tokens=3, success=False)]
    out = ss.matched_requests(base, mixed, {1: 0, 3: 1})
    assert [r.output_len for r in out] == [50, 17, 50, 50]  # a failed one keeps the requested length
    assert all(r.extra_body is None for r in out)


def test_check_output():
    doc = json.dumps(SERVING_SCHEMAS[0].document)
    assert ss.check_output(timing(text=doc), PERSON) == "valid"
    assert ss.check_output(timing(text=doc[:-1], finish="length"), PERSON) == "truncated"
    assert ss.check_output(timing(text=doc[:-1]), PERSON) == "invalid"  # ended, but not JSON
    wrong = json.dumps({**SERVING_SCHEMAS[0].document, "age": 200})
    assert ss.check_output(timing(text=wrong), PERSON) == "invalid"  # JSON, not of the schema
    assert ss.check_output(timing(success=False), PERSON) == "failed"
    s = ss.structured_summary([timing(text=doc), timing(text="x"), timing(text=doc)], {0: 0, 1: 0}, [PERSON])
    assert (s["valid"], s["invalid"], s["requests"], s["honoured"]) == (1, 1, 2, False)
    assert "did not honour" in s["warning"]
    none = ss.structured_summary([timing()], {}, [PERSON])  # no constrained request: nothing to judge
    assert none["requests"] == 0 and none["honoured"] is None and "warning" not in none


def test_compile_estimates():
    # Schema 0 first at index 1 (TTFT 50 ms), schema 1 first at 3 (30 ms); cached ones: 10, 20, 12 ms.
    ttfts = {1: 0.050, 3: 0.030, 5: 0.010, 7: 0.020, 9: 0.012}
    timings = [timing(ttft=ttfts.get(i, 0.5)) for i in range(10)]
    est = ss.in_run_compile_estimate(timings, {1: 0, 3: 1, 5: 0, 7: 1, 9: 0})
    assert est["cached_ttft_median_ms"] == pytest.approx(12.0)
    assert est["per_schema_ms"] == pytest.approx([38.0, 18.0]) and est["median_ms"] == pytest.approx(28.0)

    plan = ss.probe_requests([PERSON, PERSON], 512, 0, "p", False)
    assert [(k, role) for k, role, _ in plan] == [
        (k, role) for k in (0, 1) for role in ("new", "cached", "cached", "cached", "free")
    ]
    assert plan[0][2].extra_body == plan[1][2].extra_body and plan[4][2].extra_body is None
    ms = [9, 2, 3, 2, 1, 5, 4, 4, 6, 1]  # TTFT in ms, in plan order
    probe = ss.probe_compile_estimate(plan, [timing(ttft=x / 1e3) for x in ms])
    assert [r["compile_ms"] for r in probe["per_schema"]] == pytest.approx([7.0, 1.0])
    assert probe["median_compile_ms"] == pytest.approx(4.0)


def test_metrics_delta_and_schema_loading(tmp_path):
    before = {'g_seconds_sum{m="a"}': 1.0, 'g_seconds_count{m="a"}': 2.0, "g_total": 5.0}
    after = {'g_seconds_sum{m="a"}': 1.5, 'g_seconds_count{m="a"}': 4.0, "g_total": 5.0, "new": 1.0}
    d = ss.metrics_delta(before, after)
    assert d["delta"] == {'g_seconds_sum{m="a"}': 0.5, 'g_seconds_count{m="a"}': 2.0, "new": 1.0}
    assert d["histogram_means"] == {'g_seconds{m="a"}': 0.25}
    assert ss.metrics_delta(None, after) is None

    assert ss.load_schemas("builtin", 8) == [c.schema for c in SERVING_SCHEMAS]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([PERSON, {"type": "string", "maxLength": 3}]))
    three = ss.load_schemas(str(path), 3)
    assert three[:2] == [PERSON, {"type": "string", "maxLength": 3}]
    assert three[2] == {**PERSON, "title": "variant-copy2"}  # the pool again, under a new title
    path.write_text(json.dumps(PERSON))
    assert ss.load_schemas(str(path), 1) == [PERSON]
    for bad in ("[]", "[1]"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="--json-schema"):
            ss.load_schemas(str(path), 1)


# ---- against a real server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_honours_structured_outputs(url: str) -> bool:
    """The server asked directly: a choice between two words must come back as one of them."""
    body = {
        "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
        "prompt": [5, 6, 7],
        "max_tokens": 8,
        "temperature": 0.0,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"


def test_the_whole_run_on_the_cpu(tmp_path):
    tok = write_byte_level_tokenizer(str(tmp_path / "tok"), 512, 1, 2)  # the tiny-llama preset's ids
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = (
        f"{sys.executable} -m jaxllm.server.cli serve tiny-llama --load-format dummy --max-model-len 192 "
        f"--max-num-seqs 4 --max-num-batched-tokens 64 --tokenizer {tok} --uvicorn-log-level warning "
        f"--port {port}"
    )
    server = launch_server(command, url, 300.0)
    try:
        honoured = server_honours_structured_outputs(url)
        out = tmp_path / "result.json"
        n, output_len = 8, 160
        result = ss.main(
            ["--base-url", url, "--shape-model", "tiny-llama", "--byte-level-tokenizer", tok]
            + ["--num-prompts", str(n), "--concurrency", "4", "--input-len", "8", "--output-len", str(output_len)]
            + ["--num-schemas", "1", "--disable-any-whitespace", "--warmup-prompts", "2", "--output-json", str(out)]
        )  # fmt: skip
    finally:
        server.stop()
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "structured-serving" and saved["model"] == "tiny-llama"
    res = saved["results"]
    assert res == json.loads(json.dumps(result["results"]))
    runs = res["runs"]
    assert [runs[k]["metrics"]["completed"] for k in ss.RUNS] == [n, n, n]
    assert runs["free"]["metrics"]["total_output_tokens"] == n * output_len  # ignore_eos
    mixed, matched = runs["mixed"]["groups"], runs["matched"]["groups"]
    # Free rows ask for output_len in both runs; the matched run asks each formerly constrained row for
    # exactly what it produced under its schema.
    assert (
        mixed["free"]["total_output_tokens"] == matched["free"]["total_output_tokens"] == n // 2 * output_len
    )
    assert matched["constrained"]["total_output_tokens"] == mixed["constrained"]["total_output_tokens"]
    assert res["tpot_ratio"]["mixed_vs_matched"] == pytest.approx(
        runs["mixed"]["metrics"]["median_tpot_ms"] / runs["matched"]["metrics"]["median_tpot_ms"]
    )
    s = res["structured"]
    assert s["requests"] == n // 2 and s["valid"] + s["invalid"] + s["truncated"] + s["failed"] == n // 2
    assert s["honoured"] is honoured
    if honoured:  # each constrained row closed its (bounded, compact) JSON within max_tokens
        assert s["valid"] == n // 2 and "warning" not in s
    else:
        assert s["valid"] == 0 and "did not honour" in s["warning"]
    assert (
        len(res["compile"]["probe"]["per_schema"]) == 1
        and len(res["compile"]["in_run"]["per_schema_ms"]) == 1
    )
    # Each run's per-step attribution: the mixed run's masks are filled on the token-rules thread, the
    # other two fill none.
    per = {k: runs[k]["per_step"] for k in ss.RUNS}
    assert all(p["steps"] > 0 and p["dispatch_ms"] > 0 for p in per.values()), per
    assert per["mixed"]["token_rules_ms"] > 0 and per["free"]["token_rules_ms"] == 0, per


def test_per_step_ms():
    before = {
        'jaxllm:engine_steps_total{m="a"}': 10.0,
        'jaxllm:step_host_seconds_total{m="a",phase="dispatch"}': 1.0,
    }
    after = {
        'jaxllm:engine_steps_total{m="a"}': 110.0,
        'jaxllm:step_host_seconds_total{m="a",phase="dispatch"}': 1.2,
        'jaxllm:step_device_wait_seconds_total{m="a"}': 0.5,
    }
    assert ss.per_step_ms(before, after) == {"steps": 100.0, "dispatch_ms": 2.0, "device_wait_ms": 5.0}
    assert ss.per_step_ms(before, before) is None and ss.per_step_ms(None, after) is None
