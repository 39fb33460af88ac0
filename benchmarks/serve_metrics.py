"""Latency statistics of an online run, with vLLM benchmark_serving's definitions.

    [RequestTiming] (one per request, from the streaming client) + run duration + SLO limits
        --serving_metrics--> dict: throughputs, goodput, mean/median/std/p99 of TTFT, TPOT, ITL, E2EL (ms)

- TTFT: request sent -> first streamed token.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request (requests of one token have none).
- ITL: every gap between consecutive streamed chunks, pooled over all requests.
- E2EL: request sent -> last byte.
- Goodput: requests per second that met every given limit (ttft, tpot, e2el in ms).
Percentiles interpolate linearly between order statistics (numpy's default, as vLLM).
A run in which a request failed (or was cut) has no throughput or latency figures, only its counts and
"incomplete": tokens over the time of a run that lost requests measure the loss (benchmarks/finished.py).

A concurrency sweep keeps one `sweep_row` per level; `sweep_table` prints them as markdown, and
`check_targets` holds them against limits such as "c32:median_tpot_ms<=5.5" (`parse_target`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestTiming:
    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks after the first
    error: str = ""
    text: str = ""  # the streamed text
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r} must be NAME:MS with NAME one of {SLO_METRICS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be > 0 ms")
        out[name] = ms
    return out


def meets_slo(t: RequestTiming, limits_ms: dict[str, float]) -> bool:
    if not t.success:
        return False
    values = {"ttft": t.ttft, "tpot": t.tpot if t.tpot is not None else 0.0, "e2el": t.latency}
    return all(values[k] * 1000.0 <= v for k, v in limits_ms.items())


def describe(values_s: Sequence[float], prefix: str) -> dict[str, float]:
    """mean/median/std/pNN of seconds, reported in milliseconds; zeros when there are no values."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        a = np.zeros(1)
    out = {
        f"mean_{prefix}_ms": float(a.mean()),
        f"median_{prefix}_ms": float(np.median(a)),
        f"std_{prefix}_ms": float(a.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(a, p))
    return out


def serving_metrics(
    timings: Sequence[RequestTiming], duration_s: float, goodput_ms: dict[str, float] | None = None
) -> dict[str, float]:
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    ok = [t for t in timings if t.success]
    n_in = sum(t.prompt_len for t in ok)
    n_out = sum(t.output_tokens for t in ok)
    counts = {"completed": len(ok), "failed": len(timings) - len(ok), "duration_s": duration_s}
    if not timings or len(ok) != len(timings):
        return {**counts, "incomplete": True}
    out: dict[str, float] = {
        **counts,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
    }
    if goodput_ms:
        good = sum(meets_slo(t, goodput_ms) for t in timings)
        out["good_requests"] = good
        out["request_goodput"] = good / duration_s
    out.update(describe([t.ttft for t in ok], "ttft"))
    out.update(describe([t.tpot for t in ok if t.tpot is not None], "tpot"))
    out.update(describe([x for t in ok for x in t.itl], "itl"))
    out.update(describe([t.latency for t in ok], "e2el"))
    return out


# ---- a concurrency sweep ---------------------------------------------------------------------------------
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
ROW_STATS = ("median", "mean", "p99")
ROW_RATES = ("output_throughput", "total_token_throughput", "request_throughput")


def sweep_row(
    concurrency: int | None, metrics: dict[str, float], gpu_util_pct: float | None, **extra: Any
) -> dict[str, Any]:
    """One level of a sweep: median/mean/p99 of every latency, the throughputs, GPU utilization."""
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "num_prompts": int(metrics["completed"] + metrics["failed"]),
        "completed": int(metrics["completed"]),
        "failed": int(metrics["failed"]),
        "gpu_util_pct": gpu_util_pct,
    }
    # An incomplete level (serving_metrics) has no figures: its cells are None.
    for k, _ in LATENCIES:
        for stat in ROW_STATS:
            row[f"{stat}_{k}_ms"] = metrics.get(f"{stat}_{k}_ms")
    for k in ROW_RATES:
        row[k] = metrics.get(k)
    row.update(extra)
    return row


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per concurrency; each latency cell is "median / mean / p99" in ms."""
    head = ["concurrency", "requests ok/sent"]
    head += [f"{label} ms med / mean / p99" for _, label in LATENCIES]
    head += ["output tok/s", "req/s", "GPU util"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        util = "n/a" if r.get("gpu_util_pct") is None else f"{r['gpu_util_pct']:.0f}%"
        ok = f"{r['completed']}/{r['num_prompts']}" + (" (cut)" if r.get("cut") else "")
        cells = [str(r["concurrency"] or "all"), ok]
        if r.get("output_throughput") is None:  # not every request finished: no figures
            cells += ["incomplete"] * (len(LATENCIES) + 2) + [util]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        for k, _ in LATENCIES:
            cells.append(" / ".join(f"{r[f'{stat}_{k}_ms']:.2f}" for stat in ROW_STATS))
        cells += [f"{r['output_throughput']:,.1f}", f"{r['request_throughput']:.2f}", util]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_TARGET = re.compile(r"c(\d+):([a-z0-9_]+)(<=|>=)([0-9.eE+-]+)")


def parse_target(spec: str) -> dict[str, Any]:
    """Parse "c32:median_tpot_ms<=5.5" -> {concurrency: 32, metric: median_tpot_ms, op: <=, limit: 5.5}."""
    m = _TARGET.fullmatch(spec.replace(" ", ""))
    if not m:
        raise ValueError(
            f"--target {spec!r} must look like c32:median_tpot_ms<=5.5 or c1:output_throughput>=250"
        )
    try:
        limit = float(m.group(4))
    except ValueError:
        raise ValueError(f"--target {spec!r}: {m.group(4)!r} is not a number") from None
    return {
        "target": spec,
        "concurrency": int(m.group(1)),
        "metric": m.group(2),
        "op": m.group(3),
        "limit": limit,
    }


def check_targets(rows: list[dict[str, Any]], specs: Sequence[str]) -> list[dict[str, Any]]:
    """Each target with the measured value and `met` (None when its level did not run)."""
    by_conc = {r["concurrency"]: r for r in rows}
    out = []
    for spec in specs:
        t = parse_target(spec)
        row = by_conc.get(t["concurrency"])
        if row is not None and t["metric"] not in row:
            raise ValueError(f"--target {spec!r}: no metric {t['metric']!r}; one of {sorted(row)}")
        value = None if row is None else row[t["metric"]]
        met = None
        if value is not None:
            met = value <= t["limit"] if t["op"] == "<=" else value >= t["limit"]
        out.append({**t, "measured": value, "met": met})
    return out


def targets_table(targets: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | met |", "|---|---:|---|"]
    for t in targets:
        value = "n/a" if t["measured"] is None else f"{t['measured']:,.2f}"
        met = {True: "yes", False: "NO", None: "not run"}[t["met"]]
        lines.append(f"| c={t['concurrency']} {t['metric']} {t['op']} {t['limit']:g} | {value} | {met} |")
    return "\n".join(lines)
