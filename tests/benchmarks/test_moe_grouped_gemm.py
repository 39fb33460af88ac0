"""benchmarks/moe_grouped_gemm on the CPU: each grouped way computes what the dense masked einsum does, and a
way that cannot run (a missing lowering, an out-of-memory) is recorded as such while the sweep goes on."""

from __future__ import annotations

from benchmarks import moe_grouped_gemm as bench


def test_grouped_ways_equal_the_dense_einsum():
    result = bench.main(["--model", "tiny-qwen3-moe", "--tokens", "1,16", "--dtype", "float32", "--reps", "1",
                         "--no-save"])  # fmt: skip
    rows = result["results"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    for r in rows:
        assert r["ragged_dot_ms"] > 0 and r["dense_einsum_ms"] > 0 and r["bound_ms"] > 0
        assert r["ragged_dot_max_err_vs_dense"] < 1e-5, r
        assert r["grouped_matmul_pallas_ms"] > 0 and r["grouped_matmul_pallas_max_err_vs_dense"] < 1e-5, r


def test_a_way_that_fails_is_recorded_and_the_sweep_goes_on(monkeypatch):
    real = bench.moe_experts
    calls = []

    def missing_lowering(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first token count only
            raise ModuleNotFoundError("No module named 'jax._src.lax.pallas_lowerings'")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "moe_experts", missing_lowering)
    rows = bench.main(["--model", "tiny-qwen3-moe", "--tokens", "2,4", "--dtype", "float32", "--reps", "1",
                       "--no-save"])["results"]["rows"]  # fmt: skip
    assert rows[0]["ragged_dot_ms"] is None
    assert rows[0]["ragged_dot_error"].startswith("ModuleNotFoundError: No module named")
    assert "ragged_dot_max_err_vs_dense" not in rows[0] and rows[0]["dense_einsum_ms"] > 0
    assert rows[1]["ragged_dot_ms"] > 0 and rows[1]["ragged_dot_max_err_vs_dense"] < 1e-5
