"""benchmarks/trace_cost.py on a tiny model: both layer-trace modes lower every bucket of the start-up
plan to the same program, and the result file records each variant."""

from __future__ import annotations

import json

from benchmarks import trace_cost


def test_both_modes_lower_the_same_programs(tmp_path):
    out = tmp_path / "trace.json"
    rc = trace_cost.main(
        ["--model", "tiny-llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--max-model-len", "64", "--num-blocks", "8", "--output-json", str(out)]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())["results"]
    assert result["same_programs"] is True
    plain, once = result["modes"]["plain"]["variants"], result["modes"]["once"]["variants"]
    assert [v["shape"] for v in plain] == [v["shape"] for v in once] and len(plain) >= 3
    assert all(v["lower_s"] > 0 for v in plain + once)
