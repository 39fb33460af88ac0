"""The printed tables of benchmarks/kernel_sweep.py: each shape's best variant of ours and of JAX's kernel,
every variant's KV read bandwidth at the main shapes, and the correctness checks."""

from __future__ import annotations


def _best(results):
    """(name, result) of the fastest timed entry whose output matched the reference, or (None, None)."""
    good = {k: v for k, v in results.items() if v.get("tbps") and v.get("check", {}).get("ok", True)}
    if not good:
        return None, None
    name = max(good, key=lambda k: good[k]["tbps"])
    return name, good[name]


def summarize_row(row):
    bo, ro = _best(row["ours"])
    bj, rj = _best(row["jax"])
    row["best"] = dict(
        ours=bo,
        ours_tbps=ro and ro["tbps"],
        default_tbps=row["ours"].get("default", {}).get("tbps"),
        jax=bj,
        jax_tbps=rj and rj["tbps"],
        xla_tbps=row["xla"].get("tbps"),
        ours_over_jax=ro and rj and ro["tbps"] / rj["tbps"],
        default_over_jax=rj and row["ours"].get("default", {}).get("tbps", 0) / rj["tbps"] or None,
    )


def _f(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def row_line(row):
    if "error" in row:
        return f"{row['batch']}x{row['context']} failed: {row['error']}"
    b = row["best"]
    return (
        f"{row['batch']}x{row['context']} L={row['layers']} default {_f(b['default_tbps'])} TB/s, best "
        f"{b['ours']} {_f(b['ours_tbps'])}, jax {b['jax']} {_f(b['jax_tbps'])}, xla {_f(b['xla_tbps'])} "
        f"({row['wall_s']} s)"
    )


def print_tables(result):
    rows = [r for r in result["shapes"] if "error" not in r]
    main = [r for r in rows if r["main"]]
    print(f"\n{result['device']}  jax {result['jax']}  KV read TB/s per layer (peak ~{result['peak_tbps']})")
    if main:
        names = list(dict.fromkeys(n for r in main for n in r["ours"]))
        cols = [f"{r['batch']}x{r['context']}" for r in main]
        print(f"{'variant':24s}" + "".join(f"{c:>11s}" for c in cols))
        for n in names:
            cells = []
            for r in main:
                v = r["ours"].get(n)
                if v is None:
                    cells.append("")
                elif "error" in v:
                    cells.append("skip" if v["error"].startswith("skipped") else "err")
                else:
                    cells.append(_f(v.get("tbps")))
            print(f"{n:24s}" + "".join(f"{c:>11s}" for c in cells))
        for label, key in (("jax best", "jax_tbps"), ("xla dense", "xla_tbps")):
            print(f"{label:24s}" + "".join(f"{_f(r['best'][key]):>11s}" for r in main))
    print(
        f"\n{'shape':12s} {'L':>2s} {'default':>8s} {'best':>6s}  {'best variant':24s} {'jax':>6s} {'xla':>6s}"
        "  best/jax  default/jax"
    )
    for r in rows:
        b = r["best"]
        print(
            f"{r['batch']}x{r['context']:<8} {r['layers']:>2d} {_f(b['default_tbps']):>8s} {_f(b['ours_tbps']):>6s}  "
            f"{str(b['ours']):24s} {_f(b['jax_tbps']):>6s} {_f(b['xla_tbps']):>6s}"
            f"  {_f(b['ours_over_jax'], '{:.2f}x'):>8s}  {_f(b['default_over_jax'], '{:.2f}x'):>11s}"
        )
    fails = [k for k, c in result["checks"].items() if not c["ok"] and "skipped" not in c.get("error", "")]
    bad = [
        (r["batch"], r["context"], n)
        for r in rows
        for n, v in {**r["ours"], **r["jax"]}.items()
        if v.get("check", {}).get("ok") is False
    ]
    ok = sum(c["ok"] for c in result["checks"].values())
    print(
        f"small-case checks: {ok} configs ok, {len(fails)} failed; timed outputs off the reference: {bad or 'none'}"
    )
    for k in fails:
        c = result["checks"][k]
        print(f"  failed {k}: {c.get('error') or c.get('rel_err')}")
    print(f"wall {result.get('wall_s')} s (compile {result.get('compile', {}).get('wall_s')} s)")
