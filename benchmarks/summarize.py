"""Collect benchmark results into one markdown page and a plot.

benchmarks/results/*.json --load_results--> grouped by "benchmark" (throughput, serve, serve-sweep, startup)
    --summary_markdown--> benchmarks/results/SUMMARY.md (one table per kind, newest first)
    --plot (matplotlib, when installed)--> benchmarks/results/summary.png

python -m benchmarks.summarize [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.workload import RESULT_KEYS, RESULTS_DIR


def load_results(results_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every result file, newest first, and the names of files that are not results."""
    out, skipped = [], []
    for path in sorted(results_dir.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            skipped.append(path.name)
            continue
        if not isinstance(r, dict) or not set(RESULT_KEYS) <= set(r):
            skipped.append(path.name)
            continue
        r["_file"] = path.name
        out.append(r)
    out.sort(key=lambda r: (r["date"], r["_file"]), reverse=True)
    return out, skipped


def _f(x: Any, fmt: str = ",.1f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, int | float):
        return format(x, fmt)
    return str(x)


def _share(r: dict[str, Any]) -> str:
    roof = r.get("roofline")
    return "n/a" if not roof else f"{100 * roof['achieved_share']:.3g}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _limits(startup: dict[str, Any]) -> str:
    """The engine's max_num_seqs / max_num_batched_tokens, as its startup info reports them."""
    seqs, tokens = startup.get("max_num_seqs"), startup.get("max_num_batched_tokens")
    return f"{seqs} / {tokens}" if seqs and tokens else "-"


def throughput_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        m, s, peer = r["results"], r.get("startup") or {}, r.get("peer")
        peer_s = "" if not peer else ("failed" if "error" in peer else _f(peer["output_tok_s"]))
        ratio = (m.get("vs_peer") or {}).get("output_tok_s")
        peer_s += f" (jaxllm {ratio:.2f}x)" if ratio else ""
        rows.append(
            [
                r["date"][:10],
                r["device"],
                f"{r['model']} ({r['name']})",
                _limits(s),
                str(m["num_requests"]),
                f"{m['input_tokens']} / {m['output_tokens']}",
                _f(m["requests_per_s"], ".2f"),
                _f(m["output_tok_s"]),
                _f(m["total_tok_s"]),
                _f(s.get("startup_wall_s") or s.get("startup_time_s")),
                _share(r),
                peer_s or "-",
            ]
        )
    return rows


def serve_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        m = r["results"]
        rows.append(
            [
                r["date"][:10],
                r["device"],
                f"{r['model']} ({r['name']})",
                str(m["completed"]),
                _f(m.get("request_throughput"), ".2f"),
                _f(m.get("output_throughput")),
                _f(m.get("mean_ttft_ms")),
                _f(m.get("p99_ttft_ms")),
                _f(m.get("mean_tpot_ms"), ".2f"),
                _f(m.get("request_goodput"), ".2f"),
                _share(r),
            ]
        )
    return rows


def summary_markdown(results: list[dict[str, Any]], skipped: list[str]) -> str:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_kind.setdefault(r["benchmark"], []).append(r)
    lines = [
        "# Benchmark results",
        "",
        f"{len(results)} result files; roofline shares are against the peaks of the card each ran on.",
        "",
    ]
    if by_kind.get("throughput"):
        lines += ["## Offline throughput", ""]
        lines += _table(
            [
                "date",
                "device",
                "model (run)",
                "seqs / tokens per step",
                "requests",
                "in / out tokens",
                "req/s",
                "output tok/s",
                "total tok/s",
                "startup s",
                "roofline",
                "peer output tok/s",
            ],
            throughput_rows(by_kind["throughput"]),
        )
        lines.append("")
    if by_kind.get("serve"):
        lines += ["## Online serving", ""]
        lines += _table(
            [
                "date",
                "device",
                "model (run)",
                "done",
                "req/s",
                "output tok/s",
                "mean TTFT ms",
                "p99 TTFT ms",
                "mean TPOT ms",
                "goodput req/s",
                "roofline",
            ],
            serve_rows(by_kind["serve"]),
        )
        lines.append("")
    for r in by_kind.get("serve-sweep", []):
        lines += [f"## Concurrency sweep: {r['model']} ({r['name']}, {r['device']}, {r['date'][:10]})", ""]
        lines += [r["results"]["table"], ""]
    if by_kind.get("startup"):
        lines += ["## Startup (process start to ready)", ""]
        lines += _table(
            ["date", "device", "what", "cold s", "warm s"],
            [
                [
                    r["date"][:10],
                    r["device"],
                    f"{r['results']['mode']}: {r['model'] or 'embedded'}",
                    _f(r["results"]["cold_s"], ".2f"),
                    _f(r["results"]["warm_s"], ".2f"),
                ]
                for r in by_kind["startup"]
            ],
        )
        lines.append("")
    if skipped:
        lines += [
            "Other JSON files here (not in the benchmark result format, skipped): " + ", ".join(skipped),
            "",
        ]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    """Output tok/s of throughput runs (with their peer) and of concurrency sweeps; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    thr = [r for r in results if r["benchmark"] == "throughput"][:12]
    sweeps = [r for r in results if r["benchmark"] == "serve-sweep"][:6]
    if not thr and not sweeps:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    labels = [f"{r['name']}\n{r['device']}" for r in thr]
    ours = [r["results"]["output_tok_s"] for r in thr]
    peers = [(r.get("peer") or {}).get("output_tok_s", 0.0) for r in thr]
    xs = range(len(thr))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="jaxllm")
    ax.bar([x + 0.2 for x in xs], peers, width=0.4, label="transformers peer")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("output tok/s")
    ax.set_title("offline throughput")
    ax.legend()
    ax = axes[1]
    for r in sweeps:
        rows = r["results"]["sweep"]
        ax.plot(
            [x["concurrency"] for x in rows],
            [x["output_throughput"] for x in rows],
            marker="o",
            label=r["name"],
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title("online serving")
    if sweeps:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Summarize benchmarks/results/*.json into SUMMARY.md and a plot.")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    results_dir = Path(args.results_dir)
    results, skipped = load_results(results_dir)
    out = results_dir / "SUMMARY.md"
    out.write_text(summary_markdown(results, skipped))
    print(f"wrote {out} ({len(results)} results)")
    png = plot(results, results_dir / "summary.png")
    print(f"wrote {png}" if png else "no plot (matplotlib is not installed, or nothing to plot)")
    return out


if __name__ == "__main__":
    main()
