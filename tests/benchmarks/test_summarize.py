"""SUMMARY.md from hand-made result files: every kind gets its table, non-results are listed as skipped."""

import json

from benchmarks.summarize import main
from benchmarks.workload import make_result


def test_summary(tmp_path):
    roof = {"achieved_share": 0.25, "line": "roofline"}
    thr = make_result(
        "throughput",
        "t1",
        "llama-3.1-8b",
        {},
        {
            "num_requests": 8,
            "input_tokens": 80,
            "output_tokens": 40,
            "requests_per_s": 2.0,
            "output_tok_s": 10.0,
            "total_tok_s": 60.0,
        },
        roof,
        startup={"startup_wall_s": 3.5},
        peer={"peer": "t", "output_tok_s": 4.0},
    )
    serve = make_result(
        "serve",
        "s1",
        None,
        {},
        {
            "completed": 8,
            "request_throughput": 1.5,
            "output_throughput": 99.0,
            "mean_ttft_ms": 12.0,
            "p99_ttft_ms": 30.0,
            "mean_tpot_ms": 2.5,
            "request_goodput": 1.25,
        },
        None,
    )
    sweep = make_result(
        "serve-sweep",
        "sw",
        None,
        {},
        {"sweep": [{"concurrency": 1, "output_throughput": 5.0}], "table": "| concurrency |\n|---:|\n| 1 |"},
        None,
    )
    start = make_result("startup", "st", None, {}, {"mode": "engine", "cold_s": 30.0, "warm_s": 5.0}, None)
    for i, r in enumerate([thr, serve, sweep, start]):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text("[1, 2]")
    md = main(["--results-dir", str(tmp_path)]).read_text()
    assert "| 8 | 80 / 40 | 2.00 | 10.0 | 60.0 | 3.5 | 25% | 4.0 |" in md
    assert "| 8 | 1.50 | 99.0 | 12.0 | 30.0 | 2.50 | 1.25 | n/a |" in md
    assert "## Concurrency sweep: embedded (sw" in md and "| 1 |" in md
    assert "| engine: embedded | 30.00 | 5.00 |" in md
    assert "skipped): other.json" in md  # listed, not summarized
