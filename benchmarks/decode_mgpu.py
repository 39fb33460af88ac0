"""Decode attention on one GPU: the persistent Mosaic GPU kernel vs the Triton kernel, per layer.

What is timed, as in kernel_sweep.py: one jitted step runs a kernel for L layers back to back, each over
its own K/V pages (L = min(8, what fits in --pool-gb), so pages stream from HBM, not L2), all with the
same q, block table and lengths; time per layer = step time / L, the median of rounds after a warm-up.
Bandwidth = KV bytes of one layer / time per layer, against PEAK_TBPS (benchmarks/kernels.py).
Shapes: Llama-3.1-8B heads (32 q, 8 kv, d 128), page 16, bf16, every sequence at the full context,
block tables a random permutation of the pool, --table-pages columns wide (the engine's tables are
max_model_len / 16 wide; the Triton kernel's split count depends on it).

Checks: every Mosaic config first runs a small ragged problem (lengths off page boundaries, a short
chunk, NaN in unused pages and page tails, padding rows) against the float32 jnp reference; the timed
layer-0 output of each kernel is compared with the Triton kernel's on the whole batch. A config that
fails to lower or compile, or whose check fails, is recorded with its error and not timed.

  PYTHONUNBUFFERED=1 python -m benchmarks.decode_mgpu --out $OUT/decode_mgpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import time
import traceback
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernel_sweep import random_tiled  # noqa: E402
from benchmarks.kernels import DT, HKV, HQ, PEAK_TBPS, PS, D, error_text, time_calls  # noqa: E402
from jaxllm.kernels.metadata import PagedAttentionMetadata  # noqa: E402
from jaxllm.kernels.mosaic_decode import DecodeMgpuConfig, decode_paged_attention_mgpu  # noqa: E402
from jaxllm.kernels.reference import ref_ragged_paged_attention  # noqa: E402
from jaxllm.kernels.triton_attention import ragged_paged_attention  # noqa: E402
from jaxllm.testing.kernel_cases import make_problem, rel_err  # noqa: E402

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

SHAPES = [
    (1, 640),
    (8, 640),
    (32, 640),
    (64, 640),
    (256, 640),
    (1000, 640),
    (32, 2048),
    (256, 2048),
    (8, 8192),
]
C = DecodeMgpuConfig
# name -> config; why each: the default (64-token blocks 4 deep, one CTA per SM); deeper ring; 128-token
# blocks (fewer barriers per byte); two CTAs per SM (2-deep rings of both fit shared memory).
CONFIGS = {
    "mgpu": C(),
    "mgpu/st6": C(stages=6),
    "mgpu/bkv128st3": C(block_kv=128, stages=3),
    "mgpu/2cta-st2": C(stages=2, num_ctas=264),
}
CHECK_TOL = 2e-2  # bf16 output, relative L2 error
SCALE = D**-0.5


def small_check(cfg) -> float:
    """Relative error against the jnp reference on a small ragged problem (see the module docstring)."""
    prob = make_problem(
        [1, 1, 3, 1, 1], [1, 17, 129, 700, 1023], hq=HQ, hkv=HKV, d=D, page_size=PS, dtype=DT, pad_rows=3
    )
    out = np.asarray(decode_paged_attention_mgpu(*prob.args(), sm_scale=SCALE, config=cfg), np.float32)
    ref = np.asarray(ref_ragged_paged_attention(*prob.args(), sm_scale=SCALE), np.float32)
    if not np.isfinite(out).all() or (out[prob.num_rows :] != 0).any():
        return float("nan")
    return rel_err(out[: prob.num_rows], ref[: prob.num_rows])


def problem(batch, ctx, n_layers, table_pages, seed=0):
    rng = np.random.default_rng(seed)
    per = ctx // PS
    pool = batch * per
    width = max(per, table_pages)
    bt = np.zeros((batch, width), np.int32)
    bt[:, :per] = rng.permutation(pool).astype(np.int32).reshape(batch, per)
    md = PagedAttentionMetadata(
        kv_lens=jnp.full((batch,), ctx, jnp.int32),
        block_tables=jnp.asarray(bt),
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([batch], jnp.int32),
    )
    meta = (jax.random.normal(jax.random.key(seed), (batch, HQ, D), DT), md)
    kvs = [
        (random_tiled(2 * i + 1, (HKV, pool, PS, D)), random_tiled(2 * i + 2, (HKV, pool, PS, D)))
        for i in range(n_layers)
    ]
    return meta, kvs


def step_fn(kernel):
    def step(meta, kvs):
        q, md = meta
        return [kernel(q, k, v, md) for k, v in kvs]

    return jax.jit(step)


def run_shape(batch, ctx, kernels, args):
    """Every kernel on one shape: time per layer, bandwidth, and layer 0's output against the Triton kernel's."""
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    n_layers = int(max(1, min(8, args.pool_gb * 1e9 // kv_bytes)))
    meta, kvs = problem(batch, ctx, n_layers, args.table_pages)
    row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes, layers=n_layers, kernels={})
    base_out = None
    for name, kernel in kernels.items():
        try:
            step = step_fn(kernel)
            t, outs = time_calls(lambda step=step: step(meta, kvs), target_s=0.05, reps=7)
            per_layer = t / n_layers
            entry = dict(s=per_layer, tbps=kv_bytes / per_layer / 1e12)
            out0 = np.asarray(outs[0], np.float32)
            if base_out is None:
                base_out = out0
            else:
                entry["rel_err_vs_triton"] = rel_err(out0, base_out)
            row["kernels"][name] = entry
            print(
                f"{batch}x{ctx} {name}: {per_layer * 1e6:.1f} us/layer, {entry['tbps']:.2f} TB/s"
                + (f", vs triton {entry['rel_err_vs_triton']:.1e}" if "rel_err_vs_triton" in entry else ""),
                flush=True,
            )
        except Exception as e:
            row["kernels"][name] = dict(error=error_text(e))
            print(f"{batch}x{ctx} {name}: ERROR\n{traceback.format_exc()}", flush=True)
    timed = {n: e["s"] for n, e in row["kernels"].items() if "s" in e}
    if "triton" in timed and len(timed) > 1:
        best = min((n for n in timed if n != "triton"), key=timed.get)
        row["best_mgpu"] = best
        row["triton_over_best_mgpu"] = timed["triton"] / timed[best]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None, help="e.g. 32x640,256x2048 (default: SHAPES)")
    ap.add_argument("--configs", default=None, help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--table-pages", type=int, default=64, help="block-table width (max_model_len / 16)")
    ap.add_argument("--pool-gb", type=float, default=24.0)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new shape after this")
    args = ap.parse_args()
    t0 = time.time()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    names = args.configs.split(",") if args.configs else list(CONFIGS)
    configs = {n: CONFIGS[n] for n in names}
    result = dict(
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        date=str(datetime.datetime.now(datetime.UTC)),
        shape=dict(hq=HQ, hkv=HKV, d=D, page_size=PS, dtype=jnp.dtype(DT).name, table_pages=args.table_pages),
        peak_tbps=PEAK_TBPS,
        configs={n: dataclasses.asdict(c) for n, c in configs.items()},
        checks={},
        shapes=[],
    )

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    kernels = {"triton": functools.partial(ragged_paged_attention, sm_scale=SCALE)}
    for name, cfg in configs.items():
        try:
            err = small_check(cfg)
            ok = err <= CHECK_TOL
            result["checks"][name] = dict(rel_err=err, ok=ok)
            print(f"check {name}: rel_err {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
        except Exception as e:
            result["checks"][name] = dict(error=error_text(e), ok=False)
            print(f"check {name}: ERROR\n{traceback.format_exc()}", flush=True)
            continue
        if ok:
            kernels[name] = functools.partial(decode_paged_attention_mgpu, sm_scale=SCALE, config=cfg)
    save()

    for batch, ctx in shapes:
        if time.time() - t0 > args.budget_s:
            result["shapes"].append(dict(batch=batch, context=ctx, skipped="over --budget-s"))
            continue
        result["shapes"].append(run_shape(batch, ctx, kernels, args))
        save()
    result["wall_s"] = time.time() - t0
    save()
    print(f"done in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
