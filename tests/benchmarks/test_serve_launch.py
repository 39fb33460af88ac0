"""serve.py's helpers on hand-made inputs, and a level cut at the sweep deadline against a real
`jaxllm serve` on the CPU (the tiny-llama preset with random weights and a synthetic tokenizer). The
sweep itself, the restart and the report run in test_gpu_suite.py."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from benchmarks import serve
from benchmarks.finished import IncompleteRun
from benchmarks.roofline import prefill_flops, shape_for_model
from benchmarks.server_process import (
    cache_file_count,
    engine_startup_from_log,
    flag_value,
    launch_server,
    write_synthetic_tokenizer,
)

TINY_VOCAB, TINY_BOS, TINY_EOS = 512, 1, 2  # jaxllm/models/presets.py "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return write_synthetic_tokenizer(str(tmp_path_factory.mktemp("tok")), TINY_VOCAB, TINY_BOS, TINY_EOS)


def server_command(tokenizer: str) -> str:
    return (
        f"{sys.executable} -m jaxllm.server.cli serve tiny-llama --load-format dummy --max-model-len 64 "
        f"--max-num-seqs 4 --max-num-batched-tokens 64 --tokenizer {tokenizer} --uvicorn-log-level warning"
    )


# ---- helpers ---------------------------------------------------------------------------------------------
def test_synthetic_tokenizer(tokenizer_dir, tmp_path):
    from jaxllm.engine.detokenizer import IncrementalDetokenizer
    from jaxllm.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    assert len(tok) == TINY_VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (TINY_BOS, TINY_EOS)
    assert tok.encode("t5 t7 t511") == [5, 7, 511]
    assert tok.decode([5, 7, 511]) == "t5 t7 t511"
    ids = [300, 4, 17, 2, 9]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 3])
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) == "t300 t4 t17 t9"  # eos (t2) is special

    saved = os.stat(os.path.join(tokenizer_dir, "tokenizer.json")).st_mtime_ns
    write_synthetic_tokenizer(tokenizer_dir, TINY_VOCAB, TINY_BOS, TINY_EOS)  # the same: left as it is
    assert os.stat(os.path.join(tokenizer_dir, "tokenizer.json")).st_mtime_ns == saved
    other = write_synthetic_tokenizer(str(tmp_path / "t"), 40, 0, 39)
    assert len(load_tokenizer(other)) == 40
    for bad in ((0, 0, 0), (10, 10, 1), (10, 1, -1)):
        with pytest.raises(ValueError, match="vocab_size"):
            write_synthetic_tokenizer(str(tmp_path / "bad"), *bad)


def test_engine_startup_from_log(tmp_path):
    from jaxllm.server.cli import startup_lines

    info = {
        "model": "llama-3.1-8b",
        "dtype": "bfloat16",
        "kv_cache_dtype": "bfloat16",
        "attention_backend": "pallas",
        "num_gpu_blocks": 54381,
        "block_size": 16,
        "kv_cache_gib": 106.213,
        "max_num_seqs": 256,
        "max_concurrency": 849.7,
        "load_time_s": 6.45,
        "compile_time_s": 133.51,
        "compiled_variants": 81,
        "startup_time_s": 148.57,
        "compilation_cache": "/tmp/jaxllm-xla",
    }
    log = tmp_path / "server.log"
    engine_line = (
        "limits: max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=8192, KV cache blocks=54381 "
        "of 16 tokens (106.213 GiB; ...), maximum concurrency 849.70x at 1024 tokens per request"
    )
    lines = [engine_line, *startup_lines(info, "http://0.0.0.0:8000")]
    log.write_text("".join(f"INFO 2026-12-02 11:00:00,000 jaxllm: {ln}\n" for ln in lines))
    got = engine_startup_from_log(str(log))
    shown_elsewhere = {
        "model",
        "dtype",
        "kv_cache_dtype",
        "attention_backend",
        "block_size",
        "max_concurrency",
    }
    expected = {k: v for k, v in info.items() if k not in shown_elsewhere}  # the engine's other lines
    assert got == {**expected, "max_model_len": 1024, "max_num_batched_tokens": 8192}
    log.write_text("Traceback (most recent call last):\n")
    assert engine_startup_from_log(str(log)) == {}
    assert engine_startup_from_log(str(tmp_path / "missing.log")) == {}


def test_flag_value_and_cache_count(tmp_path):
    cmd = "jaxllm serve m --compilation-cache-dir '/a b' --port=8001"
    assert flag_value(cmd, "--compilation-cache-dir") == "/a b"
    assert flag_value(cmd, "--port") == "8001"
    assert flag_value(cmd, "--tokenizer") is None and flag_value(None, "--port") is None
    assert cache_file_count(None) is None and cache_file_count(str(tmp_path / "none")) == 0
    (tmp_path / "c" / "sub").mkdir(parents=True)
    for name in ("c/a", "c/sub/b", "c/sub/c"):
        (tmp_path / name).write_text("x")
    assert cache_file_count(str(tmp_path / "c")) == 3


SHARED_FLAGS = ["--workload", "shared-prefix", "--prefix-len", "16", "--input-len", "6", "--output-len", "2"]


def test_levels_get_distinct_requests(tmp_path):
    args = serve.make_parser().parse_args(
        ["--sweep-concurrency", "1,4", "--sweep-num-prompts", "3,5", "--input-len", "6", "--output-len", "2"]
    )
    levels, counts = serve.level_sizes(args)
    assert (levels, counts) == ([1, 4], [3, 5])
    parts = serve.make_requests(args, 1000, [1, 2, *counts])
    shared = serve.make_parser().parse_args([*SHARED_FLAGS])
    levels = serve.make_requests(shared, 50_000, [1, 3])
    assert [len(p) for p in levels] == [2, 4]  # each with its primer
    assert {tuple(r.prompt[:16]) for r in levels[1]} != {tuple(r.prompt[:16]) for r in levels[0]}
    assert len({tuple(r.prompt[:16]) for r in levels[1]}) == 1 and all(r.input_len == 22 for r in levels[1])
    assert [len(p) for p in parts] == [1, 2, 3, 5]
    prompts = [tuple(r.prompt) for p in parts for r in p]
    assert len(set(prompts)) == 11 and all(len(p) == 6 for p in prompts)  # nothing shared: no prefix hits
    assert serve.level_sizes(serve.make_parser().parse_args(["--num-prompts", "7"])) == ([None], [7])
    for bad in (["--sweep-concurrency", "1,0"], ["--sweep-concurrency", "1,2", "--sweep-num-prompts", "3"]):
        with pytest.raises(ValueError, match="--sweep"):
            serve.level_sizes(serve.make_parser().parse_args(bad))
    # A dataset shorter than all levels together is reused from its start.
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_token_ids": [i, i + 1]}) + "\n" for i in range(4)))
    args = serve.make_parser().parse_args(["--dataset", str(data), "--output-len", "3"])
    first, second = serve.make_requests(args, None, [3, 2])
    assert [r.prompt for r in first] == [[0, 1], [1, 2], [2, 3]] and [r.prompt for r in second] == [
        [0, 1],
        [1, 2],
    ]


# ---- against a real server (the sweep and the restart: test_gpu_suite.py) -------------------------------
def test_level_cut_at_the_deadline(tokenizer_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch_server(f"{server_command(tokenizer_dir)} --port {port}", url, 300.0)
    try:
        out = tmp_path / "cut.json"
        argv = ["--base-url", url, "--shape-model", "tiny-llama", "--input-len", "8", "--output-len", "4"]
        # One untimed run first compiles what the level needs, so that on a busy machine the deadline
        # still falls inside the level (5,000 requests take far longer than 5 s), not before it starts.
        serve.main([*argv, "--num-prompts", "2", "--no-save"])
        # Shared prefix: after the untimed primer each request finds the 32-token system prompt (2 blocks
        # of 16) cached, and the H100's bound leaves its prefill out.
        shared = [
            "--workload",
            "shared-prefix",
            "--prefix-len",
            "32",
            "--num-prompts",
            "3",
            "--hardware",
            "h100",
        ]
        r = serve.main([*argv, *shared, "--no-save"])
        assert r["results"]["completed"] == 3 and r["results"]["prefix_cache_hit_rate"] == 32 / 40
        shape = shape_for_model("tiny-llama")
        assert r["roofline"]["hardware"] == "H100"
        assert r["roofline"]["prefill_flops"] == 3 * prefill_flops(shape, 40, cached_len=32)
        assert r["workload"] == "shared-prefix 32+8->4"
        argv += ["--sweep-concurrency", "1,2", "--sweep-num-prompts", "5000,4", "--output-json", str(out)]
        t0 = time.time()
        # A level whose requests did not all finish keeps its counts and no figures; the run fails.
        with pytest.raises(IncompleteRun, match="concurrency 1") as e:
            serve.main([*argv, "--sweep-deadline", str(t0 + 5.0)])
        assert time.time() - t0 < 60
        assert e.value.total == 5000 and 0 < e.value.finished < 5000 and e.value.errors == [serve.CUT]
        result = json.loads(out.read_text())
        (row,) = result["results"]["sweep"]  # the second level never started
        assert row["cut"] and row["concurrency"] == 1 and row["completed"] == e.value.finished
        assert row["completed"] + row["failed"] == 5000
        assert row["output_throughput"] is None and row["median_tpot_ms"] is None
        assert result["results"]["runs"][0]["errors"] == [serve.CUT] and result["roofline"] is None
        with pytest.raises(RuntimeError, match="no level ran"):
            serve.main([*argv, "--sweep-deadline", str(time.time() - 1), "--no-save"])
    finally:
        server.stop()


def test_gpu_monitor_polls_nvidia_smi_unless_the_interval_is_zero(monkeypatch):
    import subprocess as sp

    from benchmarks import server_process

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd[0])
        return sp.CompletedProcess(cmd, 0, stdout="40\n60\n", stderr="")

    monkeypatch.setattr(server_process.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(server_process.subprocess, "run", fake_run)
    with server_process.GpuMonitor(0) as off:
        time.sleep(0.05)
    assert calls == [] and off.mean() is None
    with server_process.GpuMonitor(0.01) as on:
        time.sleep(0.1)
    assert calls and set(calls) == {"nvidia-smi"}
    assert on.mean() == 50.0  # the mean over both GPUs of every sample


def test_waits_for_the_servers_background_compiles(monkeypatch):
    """serve.py's wait before the timed runs: it reads jaxllm:num_compiling_in_background from /metrics
    until it is 0, gives up at its limit, and does not wait on a server without the gauge."""
    from benchmarks import server_process

    pages = []

    class Page:
        def __init__(self, text):
            self.text = text

    def fake_get(url, **kwargs):
        assert url == "http://h:1/metrics"
        return Page(pages.pop(0) if len(pages) > 1 else pages[0])

    monkeypatch.setattr(server_process.httpx, "get", fake_get)
    gauge = 'jaxllm:num_compiling_in_background{{model_name="m"}} {}\n'
    head = "# HELP jaxllm:num_compiling_in_background x\n# TYPE jaxllm:num_compiling_in_background gauge\n"
    pages[:] = [head + gauge.format("5.0"), head + gauge.format("2.0"), head + gauge.format("0.0")]
    waited, left = server_process.wait_for_background_compiles("http://h:1", 10.0, poll_s=0.01)
    assert left == 0 and 0.015 < waited < 5.0 and pages == [head + gauge.format("0.0")]

    pages[:] = [head + gauge.format("4.0")]  # never done: gives up at the limit
    waited, left = server_process.wait_for_background_compiles("http://h:1", 0.1, poll_s=0.01)
    assert left == 4 and waited >= 0.1

    pages[:] = ["vllm:num_requests_running 0.0\n"]  # another server: no wait
    assert server_process.wait_for_background_compiles("http://h:1", 10.0) is None


def test_engine_step_breakdown_from_metrics(monkeypatch):
    """serve.py's per-level engine line: steps and device-wait seconds read from /metrics before and after
    a level (summed over label sets, other series ignored), turned into steps, ms per step and the share
    of the level the step thread waited on the device; None for a server without the counters."""
    from benchmarks import server_process

    page = {}

    class Page:
        def __init__(self, text):
            self.text = text

    monkeypatch.setattr(server_process.httpx, "get", lambda url, **kw: Page(page["text"]))
    metrics = (
        "# TYPE jaxllm:engine_steps counter\n"
        'jaxllm:engine_steps_total{{model_name="m"}} {steps}\n'
        'jaxllm:engine_steps_created{{model_name="m"}} 1.7e9\n'
        'jaxllm:step_device_wait_seconds_total{{model_name="m"}} {wait}\n'
        'jaxllm:step_host_seconds_total{{model_name="m",phase="schedule"}} {sched}\n'
        'jaxllm:step_host_seconds_total{{model_name="m",phase="dispatch"}} {disp}\n'
        'jaxllm:step_host_seconds_total{{model_name="m",phase="process"}} 0.0\n'
    )
    page["text"] = metrics.format(steps="100.0", wait="0.5", sched="1.0", disp="2.0")
    before = server_process.engine_counters("http://h:1")
    assert before == {
        "steps": 100.0,
        "wait_s": 0.5,
        "host_schedule_s": 1.0,
        "host_dispatch_s": 2.0,
        "host_process_s": 0.0,
    }
    page["text"] = metrics.format(steps="600.0", wait="3.5", sched="1.5", disp="3.0")
    after = server_process.engine_counters("http://h:1")
    got = server_process.step_breakdown(before, after, 4.0)
    assert abs(got["host_schedule_ms_per_step"] - 1.0) < 1e-9  # 0.5 s over 500 steps
    assert abs(got["host_dispatch_ms_per_step"] - 2.0) < 1e-9
    assert got["host_process_ms_per_step"] == 0.0
    assert got["steps"] == 500 and abs(got["mean_step_ms"] - 8.0) < 1e-9
    assert abs(got["device_wait_share"] - 0.75) < 1e-9 and abs(got["device_wait_ms_per_step"] - 6.0) < 1e-9
    page["text"] = "vllm:num_requests_running 0.0\n"
    assert server_process.engine_counters("http://h:1") is None
    assert server_process.step_breakdown(None, after, 4.0) is None
