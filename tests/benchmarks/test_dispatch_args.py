"""benchmarks/dispatch_args.py on the CPU: one row per count, the donated variant where there is one."""

from __future__ import annotations

from benchmarks import dispatch_args


def test_dispatch_args_rows(tmp_path):
    out = tmp_path / "d.json"
    result = dispatch_args.main(["--counts", "1,8", "--calls", "3", "--output-json", str(out)])
    rows = result["results"]["rows"]
    assert [r["args"] for r in rows] == [1, 8]
    assert rows[0]["donated"] == 0 and rows[0]["dispatch_donated_us"] is None
    assert rows[1]["donated"] == 7 and rows[1]["dispatch_donated_us"] > 0
    assert all(r["dispatch_us"] > 0 for r in rows) and out.exists()
