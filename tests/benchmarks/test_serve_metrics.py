"""Latency statistics and goodput on hand-made timings, checked against values worked out by hand."""

import pytest

from benchmarks.serve import arrival_gaps, model_from_launch
from benchmarks.serve_metrics import (
    RequestTiming,
    check_targets,
    parse_goodput,
    parse_target,
    serving_metrics,
    sweep_row,
    sweep_table,
    targets_table,
)

TIMINGS = [
    # prompt 10, 5 tokens: TTFT 100 ms, then 4 gaps of 100 ms -> TPOT (500 - 100) / 4 = 100 ms
    RequestTiming(True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
    # prompt 20, 3 tokens: TTFT 300 ms, gaps 50 and 150 -> TPOT (500 - 300) / 2 = 100 ms
    RequestTiming(True, prompt_len=20, output_tokens=3, ttft=0.3, latency=0.5, itl=[0.05, 0.15]),
    # one token only: no TPOT
    RequestTiming(True, prompt_len=10, output_tokens=1, ttft=0.2, latency=0.2),
]
FAILED = RequestTiming(False, prompt_len=10, error="HTTP 500")


def test_throughputs_and_counts():
    m = serving_metrics(TIMINGS, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 0) and "incomplete" not in m
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(24.5)
    assert "request_goodput" not in m


def test_a_run_with_a_failed_request_has_counts_and_no_figures():
    m = serving_metrics([*TIMINGS, FAILED], duration_s=2.0, goodput_ms={"ttft": 250})
    assert m == {"completed": 3, "failed": 1, "duration_s": 2.0, "incomplete": True}
    row = sweep_row(4, m, None, cut=True)
    assert (row["num_prompts"], row["completed"], row["output_throughput"], row["median_tpot_ms"]) == (
        4,
        3,
        None,
        None,
    )
    assert sweep_table([row]).splitlines()[2] == (
        "| 4 | 3/4 (cut) | incomplete | incomplete | incomplete | incomplete | incomplete | incomplete | n/a |"
    )


def test_percentiles():
    m = serving_metrics(TIMINGS, duration_s=2.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * (300 - 200)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["std_tpot_ms"] == pytest.approx(0.0)
    # ITL pools 6 gaps: 100 x4, 50, 150 -> mean 100, median 100, p99 between 100 and 150
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100 + 0.95 * 50)
    assert m["mean_e2el_ms"] == pytest.approx(400.0)
    assert m["p90_e2el_ms"] == pytest.approx(500.0)


def test_goodput():
    assert serving_metrics(TIMINGS, 2.0, {"ttft": 250})["good_requests"] == 2  # 300 ms TTFT misses
    m = serving_metrics(TIMINGS, 2.0, parse_goodput(["ttft:250", "tpot:50"]))
    assert m["good_requests"] == 1  # only the 1-token request (no TPOT) is within both
    assert m["request_goodput"] == pytest.approx(0.5)
    assert serving_metrics(TIMINGS, 2.0, {"e2el": 500})["good_requests"] == 3


def test_parse_goodput_errors():
    assert parse_goodput(["ttft:200", "e2el:1e4"]) == {"ttft": 200.0, "e2el": 10000.0}
    for bad in (["ttft"], ["itl:5"], ["tpot:x"], ["ttft:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_no_successes():
    m = serving_metrics([RequestTiming(False)], 1.0)
    assert m["completed"] == 0 and m["incomplete"] and "mean_ttft_ms" not in m


def test_arrivals():
    assert arrival_gaps(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(20000, 10.0, seed=1)
    assert gaps == arrival_gaps(20000, 10.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.03)  # Poisson at 10/s: mean gap 100 ms
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(1, 0.0, 0)


def test_model_from_launch():
    assert model_from_launch("jaxllm serve llama-3.1-8b --load-format dummy") == "llama-3.1-8b"
    assert model_from_launch("python -m jaxllm.entrypoints.openai.api_server --model /m --port 1") == "/m"
    assert model_from_launch("jaxllm serve --port 8000") is None


def test_sweep_row_and_table():
    m = serving_metrics(TIMINGS, duration_s=2.0)
    row = sweep_row(8, m, None, cut=False)
    assert (row["concurrency"], row["num_prompts"], row["completed"], row["failed"]) == (8, 3, 3, 0)
    assert row["median_ttft_ms"] == pytest.approx(200.0) and row["p99_ttft_ms"] == pytest.approx(298.0)
    assert row["median_tpot_ms"] == pytest.approx(100.0) and row["mean_e2el_ms"] == pytest.approx(400.0)
    assert row["output_throughput"] == pytest.approx(4.5) and row["request_throughput"] == pytest.approx(1.5)
    table = sweep_table([row, {**row, "concurrency": 32, "gpu_util_pct": 87.4, "cut": True}])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|") == 10
    # TTFT 200/200/298, TPOT 100/100/100, ITL 100/100/147.5, E2E 500/400/500 (median/mean/p99)
    assert lines[2] == (
        "| 8 | 3/3 | 200.00 / 200.00 / 298.00 | 100.00 / 100.00 / 100.00 | 100.00 / 100.00 / 147.50 | "
        "500.00 / 400.00 / 500.00 | 4.5 | 1.50 | n/a |"
    )
    assert lines[3].startswith("| 32 | 3/3 (cut) |") and lines[3].endswith("| 87% |")


def test_targets():
    rows = [
        {"concurrency": 1, "output_throughput": 260.0, "median_tpot_ms": 3.9},
        {"concurrency": 32, "median_tpot_ms": 5.6, "median_ttft_ms": 60.0},
    ]
    specs = [
        "c32:median_tpot_ms<=5.5",
        "c32:median_ttft_ms <= 60",
        "c1:output_throughput>=250",
        "c64:p99_itl_ms<=9",
    ]
    got = check_targets(rows, specs)
    assert [(t["concurrency"], t["metric"], t["op"], t["limit"]) for t in got] == [
        (32, "median_tpot_ms", "<=", 5.5),
        (32, "median_ttft_ms", "<=", 60.0),
        (1, "output_throughput", ">=", 250.0),
        (64, "p99_itl_ms", "<=", 9.0),
    ]
    assert [t["met"] for t in got] == [False, True, True, None]  # 5.6 > 5.5; 60 <= 60; 260 >= 250; not run
    assert [t["measured"] for t in got] == [5.6, 60.0, 260.0, None]
    table = targets_table(got)
    assert "| c=32 median_tpot_ms <= 5.5 | 5.60 | NO |" in table
    assert "| c=64 p99_itl_ms <= 9 | n/a | not run |" in table
    for bad in ("32:median_tpot_ms<=5", "c32:median_tpot_ms<5", "c32:median_tpot_ms<=x"):
        with pytest.raises(ValueError, match="--target"):
            parse_target(bad)
    with pytest.raises(ValueError, match="no metric 'mean_tpot'"):
        check_targets(rows, ["c1:mean_tpot<=1"])
