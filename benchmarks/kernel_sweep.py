"""Decode sweep of ragged_paged_attention's static variants on one GPU, per layer as the engine runs it.

What is timed: one jitted step runs the kernel for L layers back to back, each over its own K/V pages,
all with the same q, block table, lengths and schedule (XLA computes build_work_items once per step,
as in the engine's step); time per layer = step time / L. L = min(8, what fits in --pool-gb), so every
layer streams its pages from HBM, not L2, and the host dispatch is paid once per step. The number is
the median of --reps rounds after a warm-up; bandwidth = KV bytes of one layer / time per layer.
Shapes: Llama-3.1-8B heads (32 q, 8 kv, d 128), page 16, bf16, every sequence at the full context.
Block tables are as wide as the context unless --table-pages widens ours (JAX's kernel gets the context's
columns), as the engine's, whose tables are max_model_len / 16 wide.

Compared in the same run, timed the same way: our loop variants and tile configs (VARIANTS, on the
MAIN shapes; the default config alone on the GRID cells), JAX's Pallas paged_attention over its knobs
(pages_per_compute_block 8/16 x k_splits 4/16 x num_warps 4/8), and dense XLA attention over
contiguous K/V. Every executable is compiled first, in parallel threads (XLA compiles without the
GIL), so nothing compiles while a timing runs.

Time limits: compile jobs go in priority order (per shape: reference, our default, JAX's usual best,
dense XLA; then our variants; then JAX's other knobs) and those not started after --compile-budget-s
are dropped; past --budget-s only the first tier is timed. Dropped entries say so in the JSON.
(On the CPU, the optimised HLO of a 4-layer step holds the schedule's ops once: XLA's CSE shares them.)

Checks: each distinct resolved config of ours first runs a small ragged decode case (lengths off page
boundaries, NaN in unused pages, padding rows) against the float32 jnp reference; one that fails or
does not compile is recorded with its error and not timed. The timed output of layer 0 (ours and
JAX's) is then compared with the reference on the first sequences of the batch.

  python -m benchmarks.kernel_sweep --out $OUT/kernel_sweep.json
  python -m benchmarks.kernel_sweep --interpret --tiny --out /tmp/s.json  # CPU smoke run (interpret)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import functools
import json
import math
import os
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernel_sweep_report import print_tables, row_line, summarize_row  # noqa: E402
from benchmarks.kernels import (  # noqa: E402
    DT,
    HKV,
    HQ,
    PEAK_TBPS,
    PS,
    D,
    dense_decode_attention,
    error_text,
    jax_paged_attention_fn,
    time_calls,
)
from jaxllm.kernels.metadata import PagedAttentionMetadata  # noqa: E402
from jaxllm.kernels.reference import ref_ragged_paged_attention  # noqa: E402
from jaxllm.kernels.triton_attention import ragged_paged_attention, resolve_config  # noqa: E402
from jaxllm.testing.kernel_cases import make_problem, rel_err  # noqa: E402

MAIN = [(64, 2048), (256, 2048), (8, 32768), (64, 32768), (32, 8192)]
GRID = [(64, 512), (64, 8192), (256, 512), (256, 8192), (256, 32768), (32, 512), (32, 32768)]
TINY_MAIN, TINY_GRID = [(4, 256)], [(3, 128)]

_PF = dict(loop_layout="masked", prefetch_pages=True)
# name -> knobs over default_config; "ks_scale" multiplies the default k_splits. Why each is here:
VARIANTS = {
    "default": {},  # three loops, block-table read in the step: one K/V buffer, two CTAs per SM
    "masked": dict(loop_layout="masked"),  # one masked loop (the first version's body)
    "split+pf": dict(prefetch_pages=True),  # carried page ids: num_stages - 1 buffers in flight
    "masked+pf": dict(_PF),
    "masked+pf/ppb4s3": dict(_PF, pages_per_block=4, num_stages=3),  # 2 steps x 32 KiB, 2 CTAs/SM
    "masked+pf/ppb2s4": dict(_PF, pages_per_block=2, num_stages=4),  # 3 x 16 KiB, 3 CTAs/SM
    "masked+pf/ppb2s3w2": dict(_PF, pages_per_block=2, num_stages=3, num_warps=2),  # 4 CTAs/SM
    "masked+pf/ppb1s4w2": dict(_PF, pages_per_block=1, num_stages=4, num_warps=2),  # 6 CTAs/SM
    "split/ppb2s3w2": dict(pages_per_block=2, num_stages=3, num_warps=2),  # vLLM-like small tiles
    "masked+pf/ppb8s2": dict(_PF, pages_per_block=8, num_stages=2),  # 1 buffer issued early
    "masked+pf/w8": dict(_PF, num_warps=8),
    "default/ks*2": dict(ks_scale=2),  # more, shorter programs: wave tail vs ramp-up
    "default/ks/2": dict(ks_scale=0.5),
    "masked+pf/ks*2": dict(_PF, ks_scale=2),
    "masked+pf/ppb4s3/ks*2": dict(_PF, pages_per_block=4, num_stages=3, ks_scale=2),
    "masked+pf/ppb4s3/ks*4": dict(_PF, pages_per_block=4, num_stages=3, ks_scale=4),  # JAX's best: 4 splits
    # Few sequences (b <= 32): more splits of shorter runs, smaller key steps.
    "default/ks*4": dict(ks_scale=4),
    "default/ks*8": dict(ks_scale=8),
    "default/ppb2": dict(pages_per_block=2),
    "default/ppb2/ks*2": dict(pages_per_block=2, ks_scale=2),
    "default/ppb2/ks*4": dict(pages_per_block=2, ks_scale=4),
    "default/ppb2s3/ks*4": dict(pages_per_block=2, num_stages=3, ks_scale=4),
    "default/ppb1/ks*8": dict(pages_per_block=1, ks_scale=8),
    "default/ks*4/w2": dict(ks_scale=4, num_warps=2),
}
JAX_MAIN = [(ppcb, ks, nw, 2) for ppcb in (8, 16) for ks in (4, 16) for nw in (4, 8)]
JAX_GRID = [(8, 4, 4, 2), (16, 4, 4, 2), (8, 16, 8, 2)]
CHECK_LENS = [1, 17, 128, 129, 700, 1023, 2047, 2048]
CHECK_TOL = 2e-2  # relative L2 error, bf16 output against the float32 reference
N_CHECK_SEQS = 2

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def table_width(ctx, table_pages=None):
    """Block-table columns of our kernel's table: the context's pages, or --table-pages when wider (the
    engine's tables are max_model_len / page_size wide whatever the context)."""
    return max(ctx // PS, table_pages or 0)


def resolve(knobs, batch, ctx, table_pages=None):
    """Full static config of a variant at a decode shape (every knob explicit)."""
    knobs = dict(knobs)
    scale = knobs.pop("ks_scale", None)
    pps = table_width(ctx, table_pages)
    cfg = resolve_config(batch, batch, HQ, HKV, D, PS, pps, **knobs)
    if scale:
        cap = -(-pps // cfg["pages_per_block"])
        cfg["k_splits"] = int(min(cap, max(1, round(cfg["k_splits"] * scale))))
    return cfg


def cfg_key(cfg):
    return json.dumps(cfg, sort_keys=True)


def random_tiled(seed, shape, axis=1, block_bytes=1 << 27):
    """Normal values of `shape` (bf16), a random block of <= block_bytes repeated along `axis`: one
    output buffer however large the array (speed does not depend on the values)."""
    other = math.prod(shape) // shape[axis] * jnp.dtype(DT).itemsize
    n = max(1, block_bytes // other)
    base = math.gcd(shape[axis], 1 << (n.bit_length() - 1))
    block = list(shape)
    block[axis] = base
    x = jax.random.normal(jax.random.key(seed), tuple(block), DT)
    reps = [1] * len(shape)
    reps[axis] = shape[axis] // base
    return jnp.tile(x, reps)


class Sweep:
    def __init__(self, args):
        self.args = args
        self.interpret = args.interpret
        self.t0 = time.time()
        self.main = TINY_MAIN if args.tiny else MAIN
        self.grid = TINY_GRID if args.tiny else GRID
        if args.shapes is not None:
            self.main = [tuple(int(x) for x in bc.split("x")) for bc in args.shapes.split(",") if bc]
        if args.grid is not None:
            self.grid = [tuple(int(x) for x in bc.split("x")) for bc in args.grid.split(",") if bc]
        chosen = args.variants.split(",") if args.variants else list(VARIANTS)
        self.variants = {k: v for k, v in VARIANTS.items() if k == "default" or k in chosen}
        self.check_lens = [min(x, 300) for x in CHECK_LENS] if args.tiny else CHECK_LENS
        self.scale = D**-0.5
        self.jobs = {}  # key -> future of (compiled | None, error | None, seconds)
        self.result = dict(
            device=str(jax.devices()[0].device_kind),
            jax=jax.__version__,
            date=str(datetime.datetime.now(datetime.UTC)),
            shape=dict(hq=HQ, hkv=HKV, d=D, page_size=PS, dtype=jnp.dtype(DT).name),
            peak_tbps=PEAK_TBPS,
            interpret=self.interpret,
            variants=VARIANTS,
            checks={},
            shapes=[],
        )

    # ---- shapes and plans ----
    def table_width(self, ctx):
        return table_width(ctx, self.args.table_pages)

    def layers(self, kv_bytes):
        if self.args.tiny:
            return 2
        return int(max(1, min(8, self.args.pool_gb * 1e9 // kv_bytes)))

    def plan(self, batch, ctx, main):
        """Our resolved configs (name -> cfg, duplicates dropped) and JAX's knob tuples for a shape."""
        ours, seen = {}, set()
        for name, knobs in self.variants.items():
            if not main and name != "default":
                continue
            try:
                cfg = resolve(knobs, batch, ctx, self.args.table_pages)
            except ValueError as e:
                ours[name] = error_text(e)
                continue
            if cfg_key(cfg) not in seen:
                seen.add(cfg_key(cfg))
                ours[name] = cfg
        jcfgs = JAX_MAIN if main else JAX_GRID
        if self.args.tiny:
            jcfgs = jcfgs[:2]
        return ours, jcfgs

    def abstract(self, batch, ctx, n_layers, dense=False):
        sds = jax.ShapeDtypeStruct
        q = sds((batch, HQ, D), DT)
        if dense:
            kv = sds((batch, ctx, HKV, D), DT)
            return q, [(kv, kv)] * n_layers
        pool = batch * (ctx // PS)
        kv = sds((HKV, pool, PS, D), DT)
        i32 = jnp.int32
        md = PagedAttentionMetadata(
            kv_lens=sds((batch,), i32),
            block_tables=sds((batch, self.table_width(ctx)), i32),
            cu_q_lens=sds((batch + 1,), i32),
            num_seqs=sds((1,), i32),
        )
        return (q, md), [(kv, kv)] * n_layers

    # ---- step functions: L layers in one jit ----
    def ours_step(self, cfg):
        f = functools.partial(ragged_paged_attention, sm_scale=self.scale, interpret=self.interpret, **cfg)

        def step(meta, kvs):
            q, md = meta
            return [f(q, k, v, md) for k, v in kvs]

        return step

    def jax_step(self, pps, jcfg):
        g = jax_paged_attention_fn(pps, *jcfg, interpret=self.interpret)
        if g is None:
            return None

        def step(meta, kvs):
            q, md = meta
            qs = q * self.scale  # JAX's kernel takes no softmax scale
            bt = md.block_tables[:, :pps]  # its table: the context's pages
            return [g(qs, k, v, bt, md.kv_lens) for k, v in kvs]

        return step

    def dense_step(self):
        def step(q, kvs):
            return [dense_decode_attention(q, k, v, self.scale) for k, v in kvs]

        return step

    def ref_fn(self):
        return functools.partial(ref_ragged_paged_attention, sm_scale=self.scale)

    def ref_abstract(self, batch, ctx):
        """The jnp reference on the first N_CHECK_SEQS sequences of a shape (layer 0's pages)."""
        nc = min(N_CHECK_SEQS, batch)
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        kv = sds((HKV, batch * (ctx // PS), PS, D), DT)
        md = PagedAttentionMetadata(
            kv_lens=sds((nc,), i32),
            block_tables=sds((nc, ctx // PS), i32),
            cu_q_lens=sds((nc + 1,), i32),
            num_seqs=sds((1,), i32),
        )
        return sds((nc, HQ, D), DT), kv, kv, md

    # ---- phase 1: compile everything, in parallel ----
    def compile_jobs(self):
        """(priority, key, fn, abstract args) of every executable: what every shape needs first
        (reference, our default and its check, JAX's usual best, dense XLA), then our variants, then
        JAX's other knobs; past --compile-budget-s the jobs not yet started are dropped."""
        jobs = []
        for main, shapes in ((True, self.main), (False, self.grid)):
            for batch, ctx in shapes:
                n_layers = self.layers(batch * ctx * HKV * D * 2 * 2)
                ours, jcfgs = self.plan(batch, ctx, main)
                meta, kvs = self.abstract(batch, ctx, n_layers)
                jobs.append((0, ("ref", batch, ctx), self.ref_fn(), self.ref_abstract(batch, ctx)))
                dense = self.abstract(batch, ctx, n_layers, dense=True)
                jobs.append((0, ("xla", batch, ctx), self.dense_step(), dense))
                for name, cfg in ours.items():
                    if not isinstance(cfg, dict):
                        continue
                    prio = 0 if name == "default" else 1
                    jobs.append((prio, ("ours", batch, ctx, name), self.ours_step(cfg), (meta, kvs)))
                    f = functools.partial(
                        ragged_paged_attention, sm_scale=self.scale, interpret=self.interpret, **cfg
                    )
                    jobs.append((prio, ("check", cfg_key(cfg)), f, self.prob.args()))
                for i, jcfg in enumerate(jcfgs):
                    step = self.jax_step(ctx // PS, jcfg)
                    if step is not None:
                        jobs.append((0 if i == 0 else 2, ("jax", batch, ctx, jcfg), step, (meta, kvs)))
        return sorted(jobs, key=lambda j: j[0])

    def compile_all(self):
        def job(fn, args):
            t = time.time()
            try:
                return jax.jit(fn).lower(*args).compile(), None, time.time() - t
            except Exception as e:  # a variant that does not lower or compile is recorded, not fatal
                return None, error_text(e), time.time() - t

        self.prob = self.check_problem()
        with cf.ThreadPoolExecutor(max_workers=self.args.workers) as pool:
            for _, key, fn, args in self.compile_jobs():
                if key not in self.jobs:  # a check shared by several shapes compiles once
                    self.jobs[key] = pool.submit(job, fn, args)
            _, pending = cf.wait(list(self.jobs.values()), timeout=self.args.compile_budget_s)
            dropped = sum(f.cancel() for f in pending)
        done = [f.result()[2] for f in self.jobs.values() if not f.cancelled()]
        self.result["compile"] = dict(
            jobs=len(done),
            dropped=dropped,
            wall_s=round(time.time() - self.t0, 1),
            sum_s=round(sum(done), 1),
            max_s=round(max(done), 1),
        )
        print(
            f"compiled {len(done)} executables ({dropped} dropped) in {time.time() - self.t0:.1f} s",
            flush=True,
        )

    def compiled(self, key):
        """(executable, None) or (None, why not)."""
        fut = self.jobs.get(key)
        if fut is None or fut.cancelled():
            return None, "skipped: compile time budget"
        return fut.result()[:2]

    # ---- checks ----
    def check_problem(self):
        return make_problem(
            [1] * len(self.check_lens), self.check_lens, hq=HQ, hkv=HKV, d=D, page_size=PS, dtype=DT, seed=0
        )

    def run_checks(self):
        prob = self.prob
        ref = np.asarray(ref_ragged_paged_attention(*prob.args(), sm_scale=self.scale), np.float32)
        n = prob.num_rows
        for key in [k for k in self.jobs if k[0] == "check"]:
            exe, err = self.compiled(key)
            res = dict(cfg=json.loads(key[1]))
            if exe is None:
                res.update(ok=False, error=err)
            else:
                try:
                    out = np.asarray(exe(*prob.args()), np.float32)
                    e = rel_err(out[:n], ref[:n])
                    finite = bool(np.isfinite(out).all())
                    res.update(
                        rel_err=e,
                        max_abs_err=float(np.nanmax(np.abs(out[:n] - ref[:n]))),
                        padding_zero=bool((out[n:] == 0).all()),
                        finite=finite,
                    )
                    res["ok"] = finite and e < CHECK_TOL and res["padding_zero"]
                except Exception as ex:
                    res.update(ok=False, error=error_text(ex))
            self.result["checks"][key[1]] = res
        checks = self.result["checks"].values()
        skipped = sum("skipped" in c.get("error", "") for c in checks)
        ok = sum(c["ok"] for c in checks)
        print(
            f"small-case checks: {ok} ok, {len(checks) - ok - skipped} failed, {skipped} not compiled",
            flush=True,
        )

    # ---- phase 2: time ----
    def over_budget(self):
        return time.time() - self.t0 > self.args.budget_s

    def time_exe(self, exe, args, n_layers):
        t, out = time_calls(lambda: exe(*args), target_s=self.args.target_s, reps=self.args.reps)
        return t / n_layers, out

    def bench_check(self, out, ref, rows):
        o = np.asarray(out[0][:rows], np.float32)
        e = rel_err(o, ref)
        ok = bool(np.isfinite(o).all() and e < CHECK_TOL)
        return dict(rel_err=e, max_abs_err=float(np.nanmax(np.abs(o - ref))), ok=ok)

    def run_shape(self, batch, ctx, main):
        kv_bytes = batch * ctx * HKV * D * 2 * 2
        n_layers = self.layers(kv_bytes)
        pps, pool = ctx // PS, batch * (ctx // PS)
        row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes, layers=n_layers, main=main, ours={}, jax={})
        ours, jcfgs = self.plan(batch, ctx, main)
        rng = np.random.default_rng(batch * 100003 + ctx)
        q = jax.random.normal(jax.random.key(3), (batch, HQ, D), DT)
        bt = rng.permutation(pool).astype(np.int32).reshape(batch, pps)
        bt = jnp.asarray(np.pad(bt, ((0, 0), (0, self.table_width(ctx) - pps))))
        lens = jnp.full((batch,), ctx, jnp.int32)
        cu = jnp.arange(batch + 1, dtype=jnp.int32)
        md = PagedAttentionMetadata(
            kv_lens=lens, block_tables=bt, cu_q_lens=cu, num_seqs=jnp.asarray([batch], jnp.int32)
        )
        meta = (q, md)
        kvs = [
            tuple(random_tiled(10 + 2 * i + j, (HKV, pool, PS, D)) for j in (0, 1)) for i in range(n_layers)
        ]
        nc = min(N_CHECK_SEQS, batch)
        ref_exe, err = self.compiled(("ref", batch, ctx))
        if ref_exe is None:
            raise RuntimeError(f"the reference did not compile: {err}")
        ref_md = PagedAttentionMetadata(
            kv_lens=lens[:nc],
            block_tables=bt[:nc, :pps],
            cu_q_lens=cu[: nc + 1],
            num_seqs=jnp.asarray([nc], jnp.int32),
        )
        ref_args = (q[:nc], *kvs[0], ref_md)
        ref = np.asarray(ref_exe(*ref_args), np.float32)
        del ref_args  # holds layer 0's pages, which must go before the dense copies come
        for name, cfg in ours.items():
            res = row["ours"][name] = dict(knobs=self.variants[name])
            if not isinstance(cfg, dict):
                res["error"] = cfg
                continue
            res["cfg"] = cfg
            res["programs"] = HKV * batch * cfg["k_splits"]
            check = self.result["checks"].get(cfg_key(cfg), {})
            exe, err = self.compiled(("ours", batch, ctx, name))
            if err or not check.get("ok"):
                res["error"] = err or f"small-case check failed: {check.get('error') or check.get('rel_err')}"
                continue
            if name != "default" and self.over_budget():
                res["error"] = "skipped: time budget"
                continue
            try:
                t, out = self.time_exe(exe, (meta, kvs), n_layers)
                res.update(s=t, tbps=kv_bytes / t / 1e12, check=self.bench_check(out, ref, nc))
            except Exception as e:
                res["error"] = error_text(e)
        for jcfg in jcfgs:
            name = "ppcb{}_ks{}_nw{}_ns{}".format(*jcfg)
            key = ("jax", batch, ctx, jcfg)
            if key not in self.jobs:
                row["jax"][name] = dict(error="knobs do not divide the page count")
                continue
            exe, err = self.compiled(key)
            if err or (jcfg != jcfgs[0] and self.over_budget()):  # the first is JAX's usual best
                row["jax"][name] = dict(error=err or "skipped: time budget")
                continue
            try:
                t, out = self.time_exe(exe, (meta, kvs), n_layers)
                row["jax"][name] = dict(s=t, tbps=kv_bytes / t / 1e12, check=self.bench_check(out, ref, nc))
            except Exception as e:
                row["jax"][name] = dict(error=error_text(e))
        del kvs, meta
        exe, err = self.compiled(("xla", batch, ctx))
        row["xla"] = dict(error=err)
        if exe is not None:
            try:
                dkv = [
                    tuple(random_tiled(50 + 2 * i + j, (batch, ctx, HKV, D)) for j in (0, 1))
                    for i in range(n_layers)
                ]
                t, _ = self.time_exe(exe, (q, dkv), n_layers)
                row["xla"] = dict(s=t, tbps=kv_bytes / t / 1e12)
                del dkv
            except Exception as e:
                row["xla"] = dict(error=error_text(e))
        summarize_row(row)
        return row

    def warm_up(self, seconds=1.5):
        """Busy the GPU for a moment so clocks have ramped up before the first timing."""
        if self.interpret:
            return
        x = jnp.ones((8192, 8192), DT)
        t = time.time()
        while time.time() - t < seconds:
            jax.block_until_ready([x @ x for _ in range(10)])

    def run(self):
        self.compile_all()
        self.run_checks()
        self.warm_up()
        for main, shapes in ((True, self.main), (False, self.grid)):
            for batch, ctx in shapes:
                t = time.time()
                try:
                    row = self.run_shape(batch, ctx, main)
                except Exception as e:  # e.g. out of memory: the shape is recorded, the sweep goes on
                    row = dict(batch=batch, context=ctx, main=main, error=error_text(e))
                row["wall_s"] = round(time.time() - t, 2)
                self.result["shapes"].append(row)
                self.save()
                print(row_line(row), flush=True)
        self.result["wall_s"] = round(time.time() - self.t0, 1)
        self.save()
        print_tables(self.result)

    def save(self):
        with open(self.args.out, "w") as f:
            json.dump(self.result, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}-kernel-sweep.json")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--tiny", action="store_true", help="small shapes, two layers, fewer JAX configs")
    ap.add_argument("--shapes", default=None, help="main shapes as BxCTX,BxCTX (all variants)")
    ap.add_argument(
        "--grid", default=None, help="grid shapes as BxCTX,... (default config only); '' for none"
    )
    ap.add_argument("--variants", default=None, help="comma list of VARIANTS names (default: all)")
    ap.add_argument(
        "--table-pages",
        type=int,
        default=None,
        help="block-table width of our kernel, as the engine's max_model_len / 16 (default: the context's pages)",
    )
    ap.add_argument("--pool-gb", type=float, default=20.0, help="K/V bytes of all layers of one step")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--budget-s", type=float, default=120.0, help="past it, only defaults are timed")
    ap.add_argument(
        "--compile-budget-s", type=float, default=75.0, help="compile jobs not started by then are dropped"
    )
    ap.add_argument("--target-s", type=float, default=0.02, help="length of one timing round")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.tiny:
        args.target_s, args.reps = 0.0, 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Sweep(args).run()


if __name__ == "__main__":
    main()
