"""benchmarks/research_serving.py: its request mix on hand-checked cases, and the whole run against a real
`jaxllm serve --enable-research-api` on the CPU (the tiny-llama preset, random weights), checking the JSON
it writes: both kinds of run with every request done, the groups' sizes and token counts, the ratio, and
the probe's captures against the model's shape."""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
import pytest

from benchmarks import research_serving as rs
from benchmarks.server_process import launch_server
from benchmarks.workload import BenchRequest


def test_layers_spread_over_the_model():
    assert rs.spread_layers(32, 4) == [0, 10, 21, 31]
    assert rs.spread_layers(2, 2) == [0, 1] and rs.spread_layers(30, 1) == [0]
    with pytest.raises(ValueError, match="capture-layers"):
        rs.spread_layers(2, 3)


def test_research_groups_are_disjoint_spread_and_sized():
    capture, steer = rs.research_groups(1000, 0.1, 0.1)
    assert not set(capture) & set(steer)
    assert abs(len(capture) - 100) <= 2 and abs(len(steer) - 100) <= 2
    for group in (capture, steer):  # spread: no run of 30 requests without one of each kind
        assert max(np.diff([-1, *group, 1000])) <= 30
    assert rs.research_groups(10, 0.0, 0.0) == ([], [])
    assert sorted(sum(rs.research_groups(10, 0.5, 0.5), [])) == list(range(10))
    for bad in ((1.5, 0.0), (0.6, 0.6)):
        with pytest.raises(ValueError, match="fraction"):
            rs.research_groups(10, *bad)


def test_research_requests_keep_lengths_and_carry_the_fields():
    base = [BenchRequest([i, i + 1], 2, 7) for i in range(5)]
    vec = rs.unit_vector(8, 0)
    assert np.linalg.norm(vec) == pytest.approx(1.0, rel=1e-6)
    cap, steer = rs.capture_body([0, 3], "generated"), rs.steer_body("residual.1", vec, 2.0)
    out = rs.research_requests(base, [1], [3, 4], cap, steer)
    assert [r.output_len for r in out] == [7] * 5 and [r.prompt for r in out] == [r.prompt for r in base]
    assert out[0].extra_body is None and out[2].extra_body is None
    assert out[1].extra_body == {
        "research": {"capture": ["residual.0", "residual.3"], "capture_positions": "generated"}
    }
    s = out[3].extra_body["research"]["steer"][0]
    assert s["site"] == "residual.1" and s["scale"] == 2.0 and np.allclose(s["vector"], vec)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_whole_run_on_the_cpu(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = (
        f"{sys.executable} -m jaxllm.server.cli serve tiny-llama --load-format dummy --max-model-len 64 "
        f"--max-num-seqs 4 --max-num-batched-tokens 64 --enable-research-api --uvicorn-log-level warning "
        f"--port {port}"
    )
    server = launch_server(command, url, 300.0)
    out = tmp_path / "result.json"
    n, output_len = 8, 12
    try:
        result = rs.main(
            ["--base-url", url, "--shape-model", "tiny-llama", "--num-prompts", str(n), "--concurrency", "4"]
            + ["--input-len", "8", "--output-len", str(output_len), "--capture-fraction", "0.25"]
            + ["--steer-fraction", "0.25", "--capture-layers", "2", "--repeats", "1", "--warmup-prompts", "2"]
            + ["--compile-wait-s", "0", "--output-json", str(out)]
        )  # fmt: skip
    finally:
        server.stop()
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "research-serving" and saved["model"] == "tiny-llama"
    res = saved["results"]
    assert res == json.loads(json.dumps(result["results"]))
    capture, steer = rs.research_groups(n, 0.25, 0.25)
    assert res["research"]["capture_requests"] == len(capture) and res["research"]["steer_requests"] == len(
        steer
    )
    assert len(capture) + len(steer) == 5 and not set(capture) & set(steer)
    assert res["research"]["capture_sites"] == ["residual.0", "residual.1"]
    # The probe saw the tiny model's shape: 12 prompt positions + 8 tokens - 1 (the last is never fed back).
    assert res["probe"]["capture_shapes"] == {f"residual.{i}": [12 + 8 - 1, 64] for i in (0, 1)}
    assert res["probe"]["plain_tokens_again"] is True and res["probe"]["steer_applied"] is True
    runs = res["runs"]
    assert sorted(runs) == ["none-0", "research-0"] and res["errors"] == {"none": [], "research": []}
    for r in runs.values():
        assert r["metrics"]["completed"] == n and r["metrics"]["total_output_tokens"] == n * output_len
        assert r["per_step"]["steps"] > 0
    g = runs["research-0"]["groups"]
    assert [g[k]["completed"] for k in ("capture", "steer", "plain")] == [len(capture), len(steer), 3]
    assert runs["none-0"]["groups"]["capture"] is None
    assert res["tpot_ratio"]["research_vs_none"] == pytest.approx(
        runs["research-0"]["metrics"]["median_tpot_ms"] / runs["none-0"]["metrics"]["median_tpot_ms"]
    )
