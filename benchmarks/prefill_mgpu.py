"""Prefill attention on one GPU: our Mosaic GPU kernel vs our Triton kernel vs cuDNN.

Shapes: 4 x 2048 and 1 x 8192 causal, the q chunk being the whole prompt (kv_len = q_len), with
Llama-3.1-8B heads (32 q / 8 kv, d 128), page 16, bf16, block tables a random permutation of the pool.
cuDNN (`jax.nn.dot_product_attention(..., implementation="cudnn")`) gets the same K/V laid out
contiguously [B, L, H, D]. TFLOP/s counts the causal half: 2 * 2 * Hq * D * L^2 / 2 per sequence.
Time: median over `reps` rounds of the mean of n back-to-back calls, after a compile and a warm-up.

Correctness: each output's relative error against cuDNN's (at these sizes the jnp reference would need
the per-token gathered K/V, ~100 GB), and each Mosaic config once on a small problem against the jnp
reference (2 sequences, context before the chunk, pages not aligned). A kernel that fails to lower or
compile is recorded (its traceback goes to the log) and the run goes on. Results are written to --out
after every measurement, so a run cut short still leaves what it measured.

  PYTHONUNBUFFERED=1 python -m benchmarks.prefill_mgpu --out $OUT/prefill_mgpu.json 2>&1 | tee $OUT/prefill_mgpu.log

The default configuration of each shape runs first (cuDNN, Triton, Mosaic aligned and padded), then the
sweep until --budget-s (75 s) has passed; about 2 minutes in all if a Mosaic compile takes ~5 s. A step
that runs past --step-limit-s (a deadlocked kernel never returns) saves the JSON with "hung_in" and
exits with status 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import DT, HKV, HQ, PS, D, prefill_problem, time_calls  # noqa: E402
from jaxllm.kernels.metadata import PagedAttentionMetadata  # noqa: E402
from jaxllm.kernels.mosaic_prefill import MgpuConfig, prefill_paged_attention_mgpu  # noqa: E402
from jaxllm.kernels.reference import ref_ragged_paged_attention  # noqa: E402
from jaxllm.kernels.triton_attention import ragged_paged_attention  # noqa: E402
from jaxllm.testing.kernel_cases import rel_err  # noqa: E402

SHAPES = ((4, 2048), (1, 8192))
# Sweep after the default MgpuConfig(): one CTA per unit (not persistent); 64-token blocks 3 deep;
# 128-token blocks 3 deep (one Q buffer to fit); no tensor-core turn-taking; P through shared memory.
SWEEP = (
    MgpuConfig(persistent=False),
    MgpuConfig(block_kv=64, stages=3),
    MgpuConfig(stages=3, q_buffers=1),
    MgpuConfig(schedule_barrier=False),
    MgpuConfig(pv_mode="smem"),
)
MAX_REL_ERR = 2e-2  # bf16


def config_name(cfg: MgpuConfig | None) -> str:
    if cfg is None:
        return "default"
    base = MgpuConfig()
    diff = [
        f"{f.name}={getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) != getattr(base, f.name)
    ]
    return ",".join(diff) or "default"


def small_reference_check(cfg: MgpuConfig | None) -> float:
    """Relative error against the jnp reference: 2 sequences, 128/256-row chunks after 45/0 tokens of context."""
    rng = np.random.default_rng(7)
    q_lens, kv_lens = [128, 256], [173, 256]
    pages = [-(-k // PS) for k in kv_lens]
    pool = sum(pages) + 3
    perm = rng.permutation(pool).astype(np.int32)
    bt = np.zeros((2, max(pages)), np.int32)
    bt[0, : pages[0]], bt[1, : pages[1]] = perm[: pages[0]], perm[pages[0] : sum(pages)]
    k = rng.standard_normal((HKV, pool, PS, D)).astype(np.float32)
    v = rng.standard_normal((HKV, pool, PS, D)).astype(np.float32)
    for s, kl in enumerate(kv_lens):  # garbage past kv_len in the last page must not leak
        v[:, bt[s, pages[s] - 1], kl - (pages[s] - 1) * PS :] = np.nan
    md = PagedAttentionMetadata(
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(bt),
        cu_q_lens=jnp.asarray([0, q_lens[0], sum(q_lens)], jnp.int32),
        num_seqs=jnp.asarray([2], jnp.int32),
    )
    args = (
        jnp.asarray(rng.standard_normal((sum(q_lens), HQ, D)), DT),
        jnp.asarray(k, DT),
        jnp.asarray(v, DT),
        md,
    )
    ref = ref_ragged_paged_attention(*args, sm_scale=D**-0.5)
    out = prefill_paged_attention_mgpu(*args, sm_scale=D**-0.5, q_tile_aligned=True, config=cfg)
    out = np.asarray(out, np.float32)
    return float("nan") if not np.isfinite(out).all() else rel_err(out, ref)


class Watchdog:
    """A kernel that deadlocks never returns: after `limit_s` in one step, save what we have and exit."""

    def __init__(self, limit_s, on_timeout):
        self.limit_s, self.on_timeout = limit_s, on_timeout
        self.step, self.since = None, None
        threading.Thread(target=self._run, daemon=True).start()

    def start(self, step):
        self.step, self.since = step, time.perf_counter()

    def stop(self):
        self.step = None

    def _run(self):
        while True:
            time.sleep(1.0)
            step, since = self.step, self.since
            if step is not None and time.perf_counter() - since > self.limit_s:
                print(
                    f"WATCHDOG: '{step}' still running after {self.limit_s:.0f} s (hung kernel?); exiting",
                    flush=True,
                )
                self.on_timeout(step)
                os._exit(3)


WATCHDOG: Watchdog | None = None


def measure(name, fn, ref_out, log_row):
    """Times fn(); records seconds and the relative error against ref_out, or the error with its traceback."""
    t0 = time.perf_counter()
    if WATCHDOG is not None:
        WATCHDOG.start(name)
    try:
        t, out = time_calls(fn, target_s=0.03)
        log_row[f"{name}_s"] = t
        if ref_out is not None:
            log_row[f"{name}_rel_err_vs_cudnn"] = rel_err(out, ref_out)
        print(f"  {name}: {t * 1e3:.3f} ms ({time.perf_counter() - t0:.1f} s with compile)", flush=True)
        return out
    except Exception as e:  # a kernel that fails to lower/compile is a result, not the end of the run
        print(f"  {name}: FAILED\n{traceback.format_exc()}", flush=True)
        lines = str(e).strip().splitlines() or [""]
        log_row[f"{name}_error"] = f"{type(e).__name__}: {lines[0][:300]}"
        return None
    finally:
        if WATCHDOG is not None:
            WATCHDOG.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--budget-s", type=float, default=75.0, help="no new sweep config after this")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--step-limit-s", type=float, default=90.0, help="exit if one measurement hangs this long"
    )
    args = ap.parse_args()
    start = time.perf_counter()
    dev = jax.devices()[0]
    result = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=str(getattr(dev, "device_kind", dev)),
        jax=jax.__version__,
        heads=dict(hq=HQ, hkv=HKV, d=D, page_size=PS, dtype=jnp.dtype(DT).name),
        shapes=[],
        reference_checks={},
    )

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(f"device {result['device']}, jax {jax.__version__}", flush=True)

    def on_hang(step):
        result["hung_in"] = step
        save()

    global WATCHDOG
    WATCHDOG = Watchdog(args.step_limit_s, on_hang)
    problems = {}  # (batch, length) -> (paged args, cuDNN output as [T, Hq, D] or None)
    scale = D**-0.5
    for batch, length in SHAPES:
        flops = 4 * batch * HQ * D * length * length / 2
        row = dict(batch=batch, length=length, flops=flops, sweep={})
        result["shapes"].append(row)
        paged, dense = prefill_problem(batch, length)
        print(f"{batch} x {length} causal ({flops / 1e9:.0f} GFLOP)", flush=True)
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, scale=scale, implementation="cudnn"
            )
        )
        ref = measure("cudnn", lambda cudnn=cudnn, dense=dense: cudnn(*dense), None, row)
        ref = None if ref is None else ref.reshape(batch * length, HQ, D)
        problems[(batch, length)] = (paged, ref)
        triton = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale))
        measure("triton", lambda triton=triton, paged=paged: triton(*paged), ref, row)
        mosaic = jax.jit(lambda *a: prefill_paged_attention_mgpu(*a, sm_scale=scale, q_tile_aligned=True))
        measure("mosaic", lambda mosaic=mosaic, paged=paged: mosaic(*paged), ref, row)
        padded = jax.jit(lambda *a: prefill_paged_attention_mgpu(*a, sm_scale=scale, q_tile_aligned=False))
        measure("mosaic_padded", lambda padded=padded, paged=paged: padded(*paged), ref, row)
        save()

    def reference_check(name, cfg):
        WATCHDOG.start(f"reference check {name}")
        try:
            result["reference_checks"][name] = e = small_reference_check(cfg)
            print(f"  reference check {name}: rel. err {e:.2e}", flush=True)
        except Exception as e:
            print(f"reference check {name}: FAILED\n{traceback.format_exc()}", flush=True)
            result["reference_checks"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            WATCHDOG.stop()
        save()

    reference_check("default", None)

    if not args.no_sweep:
        for cfg in SWEEP:
            if time.perf_counter() - start > args.budget_s:
                print(
                    f"budget of {args.budget_s:.0f} s reached: sweep stops before {config_name(cfg)}",
                    flush=True,
                )
                break
            name = config_name(cfg)
            print(f"config {name}", flush=True)
            for row in result["shapes"]:
                paged, ref = problems[(row["batch"], row["length"])]
                entry = {}
                f = jax.jit(
                    lambda *a, cfg=cfg: prefill_paged_attention_mgpu(
                        *a, sm_scale=scale, q_tile_aligned=True, config=cfg
                    )
                )
                measure("mosaic", lambda f=f, paged=paged: f(*paged), ref, entry)
                row["sweep"][name] = entry
                save()
            reference_check(name, cfg)

    for r in result["shapes"]:
        for key in ("cudnn", "triton", "mosaic", "mosaic_padded"):
            t = r.get(f"{key}_s")
            r[f"{key}_tflops"] = r["flops"] / t / 1e12 if t else None
        for entry in r["sweep"].values():
            t = entry.get("mosaic_s")
            entry["mosaic_tflops"] = r["flops"] / t / 1e12 if t else None
    result["wall_s"] = time.perf_counter() - start
    save()

    def fmt(x, spec=".0f"):
        return "-" if x is None else (format(x, spec) if isinstance(x, float) else str(x))

    print(f"\nprefill TFLOP/s on {result['device']} (Hq {HQ}, Hkv {HKV}, d {D}, page {PS}, bf16, causal)")
    print(f"{'shape':>10} {'cudnn':>7} {'triton':>7} {'mosaic':>7} {'padded':>7}  rel.err mosaic vs cudnn")
    for r in result["shapes"]:
        shape = f"{r['batch']}x{r['length']}"
        cells = [fmt(r.get(f"{k}_tflops")) for k in ("cudnn", "triton", "mosaic", "mosaic_padded")]
        print(
            f"{shape:>10} {cells[0]:>7} {cells[1]:>7} {cells[2]:>7} {cells[3]:>7}  {fmt(r.get('mosaic_rel_err_vs_cudnn'), '.2e')}"
        )
        for name, entry in r["sweep"].items():
            tf = fmt(entry.get("mosaic_tflops"))
            err = fmt(entry.get("mosaic_rel_err_vs_cudnn"), ".2e")
            print(
                f"{'':>10}   sweep {name:<40} {tf:>7}  {err}" + ("  ERROR" if "mosaic_error" in entry else "")
            )
    print("small-problem check vs jnp reference (rel. err):")
    for name, e in result["reference_checks"].items():
        ok = isinstance(e, float) and e < MAX_REL_ERR
        print(f"  {name:<40} {fmt(e, '.2e')}  {'ok' if ok else 'FAIL'}")
    print(f"wall {result['wall_s']:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
