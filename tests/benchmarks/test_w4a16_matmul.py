"""benchmarks/w4a16_matmul.py on a tiny model in interpret mode: one row per (token count, projection),
the kernel and XLA's two ways on u4 codes checked against XLA's dequantize-then-dot, the byte counts
those of the int4 layout."""

from __future__ import annotations

import argparse
import json

from benchmarks import w4a16_matmul as bench


def test_int4_bytes():
    # 4096 x 4096 at g = 128: 8 MiB of codes + 2 x 32 x 4096 bf16 scales/zeros.
    assert bench.int4_bytes(4096, 4096, 128) == 4096 * 4096 // 2 + 2 * 32 * 4096 * 2


def test_sweep_knobs_are_valid_overrides():
    knobs = bench.sweep_knobs(1, 4096, 4096, 128)
    assert knobs[0] == {} and len(knobs) > 4
    assert all(len(kw) == 1 for kw in knobs[1:])  # one knob at a time
    assert {"block_n", "block_k", "split_k", "num_warps", "num_stages"} <= {
        next(iter(kw)) for kw in knobs[1:]
    }


def test_report(tmp_path):
    out = tmp_path / "w4a16.json"
    bench.main(["--model", "tiny-llama", "--tokens", "3", "--layers", "1", "--warmup", "0", "--reps", "1",
                "--copy-mb", "1", "--interpret", "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["results"]["rows"]
    assert [(r["tokens"], r["group"]) for r in rows] == [(3, g) for g in ("qkv", "o", "gate_up", "down")]
    for r in rows:
        assert r["w4a16"]["max_rel_err_vs_xla"] < 2**-7, r
        assert r["w4a16"]["weight_bytes"] == bench.int4_bytes(r["k"], r["n"], r["group_size"])
        assert r["bf16_dot"]["weight_bytes"] == 2 * r["k"] * r["n"]
        assert r["xla_dequant_dot"]["us"] > 0 and r["speedup_vs_bf16_dot"] > 0
        for way in ("xla_u4_dot", "xla_u4_grouped_dot"):  # XLA on u4 codes: the same product
            assert r[way]["max_rel_err_vs_xla"] < 2**-7 and r[way]["us"] > 0, (way, r[way])
    assert result["roofline"]["bandwidth"] > 0 and result["roofline"]["copy_bandwidth"] > 0


def test_sweep_row():
    """--sweep times every knob set and names the fastest; all of them are correct."""
    args = argparse.Namespace(layers=1, warmup=0, reps=1, interpret=True, sweep=True, verbose=False)
    row = bench.bench_row("o", 1, 256, 64, 32, args, bandwidth=1e12)
    assert len(row["sweep"]) == len(bench.sweep_knobs(1, 256, 64, 32)) > 1
    assert all(e["max_rel_err_vs_xla"] < 2**-7 for e in row["sweep"]), row["sweep"]
    assert row["best"]["us"] == min(e["us"] for e in row["sweep"])
