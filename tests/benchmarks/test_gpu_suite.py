"""benchmarks/gpu_suite.py end to end on the CPU (its cpu-smoke preset: the tiny-llama shape, random
weights), which runs the real throughput.py, serve.py (a launched `jaxllm serve`), startup.py and
step_profile.py: each part's result file against what the preset asked for, and the suite's handling
of a part that runs out of time."""

from __future__ import annotations

import json
import os
import socket
import sys

import httpx
import pytest

from benchmarks import gpu_suite, serve, startup
from benchmarks.roofline import H200, decode_step_seconds, shape_for_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    port = free_port()
    result = gpu_suite.main(
        ["--out", str(out), "--preset", "cpu-smoke", "--cache-dir", str(out / "xla"), "--port", str(port)]
    )
    return out, port, result


def load(out, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_every_part_ran_and_the_suite_file_says_so(suite):
    out, _, result = suite
    parts = result["results"]["parts"]
    assert list(parts) == list(gpu_suite.PARTS)
    assert {p["status"] for p in parts.values()} == {"ok"}, {k: p["log"] for k, p in parts.items()}
    assert load(out, "suite")["results"]["parts"] == parts
    assert result["results"]["cache_files_before"] == 0
    assert parts["throughput"]["headline"]["output_tok_s"] == pytest.approx(
        load(out, "throughput")["results"]["output_tok_s"], rel=1e-2
    )


def test_throughput_part(suite):
    out, _, _ = suite
    saved = load(out, "throughput")
    r = saved["results"]
    assert saved["benchmark"] == "throughput" and saved["model"] == "tiny-llama"
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (6, 6 * 12, 6 * 4)  # ignore_eos
    assert r["output_tok_s"] == pytest.approx(24 / r["elapsed_s"], rel=1e-3)
    assert saved["device"] == "cpu" and saved["roofline"] is None  # the CPU has no card's bound
    assert saved["startup"]["max_num_seqs"] == 4 and saved["startup"]["num_gpu_blocks"] >= 4


def test_serve_part_and_the_restart(suite):
    out, port, _ = suite
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)  # the sweep's server was stopped
    saved = load(out, "serve")
    rows, runs = saved["results"]["sweep"], saved["results"]["runs"]
    assert [(r["concurrency"], r["completed"], r["failed"], r["cut"]) for r in rows] == [
        (1, 2, 0, False),
        (3, 6, 0, False),
    ]
    for n, run, row in zip((2, 6), runs, rows, strict=True):
        m = run["metrics"]
        assert (m["total_input_tokens"], m["total_output_tokens"]) == (12 * n, 4 * n)
        assert 0 < row["median_ttft_ms"] < row["median_e2el_ms"]
        assert row["output_throughput"] == pytest.approx(4 * n / m["duration_s"])
    st = saved["server_startup"]
    assert st["ready_s"] > 0 and st["log"] == str(out / "server-sweep.log")
    assert st["engine"]["max_num_seqs"] == 4 and st["engine"]["max_model_len"] == 64

    res = load(out, "startup")["results"]
    first, restart = res["passes"]
    assert first == {"pass": first["pass"], "source": str(out / "serve.json"), **st}
    assert restart["pass"] == "warm" and restart["cache_files_before"] > 0
    assert restart["engine"]["num_gpu_blocks"] == st["engine"]["num_gpu_blocks"]
    assert restart["log"] == str(out / "server-startup-0-warm.log")

    text = serve.main(["--report", str(out / "serve.json"), str(out / "startup.json")])["report"]
    assert saved["results"]["table"] in text and f"| warm | {restart['ready_s']:.1f} |" in text
    # A used cache without --keep-cache is refused: the cold pass needs an empty one.
    with pytest.raises(ValueError, match="--keep-cache"):
        startup.main(["--mode", "server", "--server-command", "x", "--cache-dir", str(out / "xla")])


def test_step_profile_part_carries_the_bandwidth_bound(suite):
    out, _, result = suite
    (row,) = load(out, "step_profile")["results"]["steps"]
    assert row["case"] == "decode 2x16" and row["back_to_back_ms"] > 0
    bound_ms = decode_step_seconds(shape_for_model("tiny-llama", "float32"), [16, 16], H200) * 1e3
    assert row["bound_ms"] == pytest.approx(bound_ms)
    assert row["back_to_back_share_of_bound"] == pytest.approx(bound_ms / row["back_to_back_ms"])
    assert "busy_share_of_bound" not in row  # the CPU has no device kernel events
    assert result["results"]["parts"]["step_profile"]["headline"]["decode 2x16"]["bound_ms"] == pytest.approx(
        bound_ms, rel=1e-2
    )


def test_a_part_out_of_time_is_stopped_with_its_server(tmp_path):
    """SIGTERM at the timeout: the child stops the server it launched (here one that never gets healthy)."""
    pid_file = tmp_path / "server.pid"
    server = f"{sys.executable} -c \"import os, time; open('{pid_file}', 'w').write(str(os.getpid())); time.sleep(120)\""
    argv = ["--mode", "server", "--server-command", server, "--port", str(free_port())]
    argv += ["--cache-dir", str(tmp_path / "xla"), "--passes", "1", "--timeout", "100", "--no-save"]
    status, _ = gpu_suite.run_child("startup", argv, tmp_path / "log", 5.0, dict(os.environ))
    assert status == "timeout"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert gpu_suite.run_child("no_such_tool", [], tmp_path / "log2", 60.0, dict(os.environ))[0] == "failed"
    with pytest.raises(ValueError, match="--only"):
        gpu_suite.parts_from("throughput,nope")
    assert gpu_suite.parts_from("startup, serve") == ["serve", "startup"]
