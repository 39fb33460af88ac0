"""Paged-attention kernel benchmark on one GPU: ours vs JAX's Pallas paged_attention, XLA, cuDNN.

Decode: batch x context with Llama-3.1-8B heads (32 q, 8 kv, d 128, page 16, bf16); the number is time
per call (median of `reps` rounds, each the mean of n back-to-back calls after a warm-up) and the
effective bandwidth = KV bytes read / time, against the ~4.3 TB/s copy bandwidth of the H200.
Small problems rotate among several page sets so repeated calls do not just read L2.
Prefill: 4 x 2048 and 1 x 8192 causal; TFLOP/s counts the causal half (4 * Hq * D * L^2 / 2 per seq).
KV write: XLA scatter under donation vs the Pallas kernel, decode (64 rows) and prefill (8192 rows).

  python -m benchmarks.kernels --out benchmarks/results/$(date +%F)-h200-kernels.json [--quick]

The decode loop variants, timed per layer inside one jitted multi-layer step, are swept by
benchmarks/kernel_sweep.py, which shares this file's timing, JAX-kernel and dense-XLA helpers.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.metadata import PagedAttentionMetadata  # noqa: E402
from jaxllm.kernels.ops import write_kv_cache_pallas, write_kv_cache_xla  # noqa: E402
from jaxllm.kernels.triton_attention import default_config, ragged_paged_attention  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
DT = jnp.bfloat16
PEAK_TBPS = 4.3
BATCHES = (1, 8, 32, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
L2_ROTATE_BYTES = 128 << 20


def bench(fn, arg_sets, target_s=0.02, reps=5):
    """Median over reps of the mean time of n back-to-back calls.

    With several arg sets (small problems rotating through L2-sized page sets), one jitted call runs
    fn once per set back to back, so the host's dispatch cost is paid once per len(arg_sets) calls.
    """
    if len(arg_sets) > 1:
        sets = arg_sets
        unrolled = jax.jit(lambda *flat: [fn(*s) for s in _split(flat, sets)])
        flat = [a for s in sets for a in s]
        return bench(lambda *a: unrolled(*a), [tuple(flat)], target_s, reps) / len(sets)
    return time_calls(lambda: fn(*arg_sets[0]), target_s, reps)[0]


def time_calls(call, target_s=0.02, reps=5):
    """(median over reps of the mean time of n back-to-back call()s, last output), after a warm-up.

    n is chosen from a first timing so one round lasts about target_s (between 3 and 200 calls).
    """
    out = call()
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(3):
        out = call()
    jax.block_until_ready(out)
    one = (time.perf_counter() - t0) / 3
    n = int(min(200, max(3, target_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times), out


def _split(flat, sets):
    out, i = [], 0
    for s in sets:
        out.append(flat[i : i + len(s)])
        i += len(s)
    return out


def try_bench(fn, arg_sets, **kw):
    try:
        return bench(fn, arg_sets, **kw), None
    except Exception as e:  # a config that does not lower or does not fit is reported, not fatal
        return None, error_text(e)


def error_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:200]}"


# JAX's Pallas paged_attention knobs tried (pages_per_compute_block, k_splits, num_warps, num_stages).
JAX_DECODE_CONFIGS = [(8, 4, 4, 2), (16, 4, 4, 2), (8, 16, 8, 2), (16, 8, 8, 3), (8, 1, 4, 3)]


def jax_paged_attention_fn(pages_per_seq, ppcb, ks, nw, ns, interpret=False):
    """JAX's Pallas paged_attention at fixed knobs, or None where they do not divide the page count.

    It takes no softmax scale: call it with q already scaled. Same q/k/v/block-table layout as ours.
    """
    if pages_per_seq % ks or (pages_per_seq // ks) % min(ppcb, pages_per_seq // ks):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    return functools.partial(
        jpa.paged_attention,
        pages_per_compute_block=ppcb,
        k_splits=ks,
        num_warps=nw,
        num_stages=ns,
        interpret=interpret,
    )


def dense_decode_attention(q, k, v, scale):
    """Plain XLA decode attention over contiguous K/V: q [B, Hq, D], k/v [B, L, Hkv, D]."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgl,blhd->bhgd", p.astype(v.dtype), v).reshape(b, hq, d)


def decode_case(batch, ctx, rng):
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    rot = int(max(1, min(8, L2_ROTATE_BYTES // kv_bytes)))
    pages_per_seq = ctx // PS
    pool = rot * batch * pages_per_seq
    k_pages = jax.random.normal(jax.random.key(1), (HKV, pool, PS, D), DT)
    v_pages = jax.random.normal(jax.random.key(2), (HKV, pool, PS, D), DT)
    q = jax.random.normal(jax.random.key(3), (batch, HQ, D), DT)
    perm = rng.permutation(pool).astype(np.int32).reshape(rot, batch, pages_per_seq)
    tables = [jnp.asarray(perm[r]) for r in range(rot)]
    lens = jnp.full((batch,), ctx, jnp.int32)
    return kv_bytes, q, k_pages, v_pages, tables, lens


def run_decode(batch, ctx, rng, quick):
    quick = quick or batch < 8 or ctx < 2048  # full sweeps only where the targets are set
    kv_bytes, q, k_pages, v_pages, tables, lens = decode_case(batch, ctx, rng)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    ns = jnp.asarray([batch], jnp.int32)
    row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes)
    scale = D**-0.5

    cfg = default_config(batch, batch, HQ, HKV, D, PS, ctx // PS)
    ours = {}
    variants = [dict(), dict(pages_per_block=4, num_stages=4, num_warps=4)]
    if not quick:
        for ppb, stages, nw in ((8, 2, 4), (16, 2, 4), (4, 4, 4), (8, 3, 8)):
            variants.append(dict(pages_per_block=ppb, num_stages=stages, num_warps=nw))
        ks = cfg["k_splits"]
        for k in sorted({max(1, ks // 2), ks * 2} - {ks}):
            variants.append(dict(k_splits=k))
    mds = [PagedAttentionMetadata(kv_lens=lens, block_tables=bt, cu_q_lens=cu, num_seqs=ns) for bt in tables]
    for var in variants:
        f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, **var))
        t, err = try_bench(lambda md, f=f: f(q, k_pages, v_pages, md), [(md,) for md in mds])
        ours[json.dumps(var, sort_keys=True)] = t if t is not None else err
    good = {k: v for k, v in ours.items() if isinstance(v, float)}
    row["ours_default_s"] = ours.get("{}") if isinstance(ours.get("{}"), float) else None
    if good:
        best = min(good, key=good.get)
        row["ours_s"], row["ours_best_config"] = good[best], json.loads(best)
    row["ours_sweep"] = ours

    # JAX's own Pallas paged_attention, at its best over a small knob sweep.
    pps = ctx // PS
    cfgs = JAX_DECODE_CONFIGS[:3] if quick else JAX_DECODE_CONFIGS
    jres = {}
    qs = q * scale  # JAX's kernel takes no softmax scale
    for ppcb, ks, nw, ns_ in cfgs:
        f = jax_paged_attention_fn(pps, ppcb, ks, nw, ns_)
        if f is None:
            continue
        f = jax.jit(f)
        t, err = try_bench(lambda bt, f=f: f(qs, k_pages, v_pages, bt, lens), [(bt,) for bt in tables])
        jres[f"ppcb{ppcb}_ks{ks}_nw{nw}_ns{ns_}"] = t if t is not None else err
    good = {k: v for k, v in jres.items() if isinstance(v, float)}
    if good:
        best = min(good, key=good.get)
        row["jax_s"], row["jax_best_config"] = good[best], best
    row["jax_sweep"] = jres

    # Dense XLA attention over contiguous K/V (what the engine would do without paging).
    rot = len(tables)
    kd = [jax.random.normal(jax.random.key(10 + r), (batch, ctx, HKV, D), DT) for r in range(rot)]
    vd = [jax.random.normal(jax.random.key(20 + r), (batch, ctx, HKV, D), DT) for r in range(rot)]
    dense = jax.jit(functools.partial(dense_decode_attention, scale=scale))
    t, err = try_bench(dense, [(q, kd[r], vd[r]) for r in range(rot)])
    row["xla_s"] = t
    if err:
        row["xla_error"] = err
    del kd, vd
    for key in ("ours", "jax", "xla"):
        t = row.get(f"{key}_s")
        row[f"{key}_tbps"] = kv_bytes / t / 1e12 if t else None
    return row


def prefill_problem(batch, length):
    """`batch` whole prompts of `length` tokens: the paged kernel's arguments (q, k_pages, v_pages, md) over
    permuted pages, and the same q/K/V contiguous per sequence ([B, L, H, D]) for cuDNN and XLA: token l
    of sequence b is row l % PS of page block_tables[b, l // PS]."""
    q = jax.random.normal(jax.random.key(1), (batch * length, HQ, D), DT)
    pages_per_seq = length // PS
    pool = batch * pages_per_seq
    k_pages = jax.random.normal(jax.random.key(2), (HKV, pool, PS, D), DT)
    v_pages = jax.random.normal(jax.random.key(3), (HKV, pool, PS, D), DT)
    bt_np = np.random.default_rng(0).permutation(pool).astype(np.int32).reshape(batch, pages_per_seq)
    lens = jnp.full((batch,), length, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * length
    ns = jnp.asarray([batch], jnp.int32)
    kb = k_pages[:, bt_np].reshape(HKV, batch, length, D).transpose(1, 2, 0, 3)
    vb = v_pages[:, bt_np].reshape(HKV, batch, length, D).transpose(1, 2, 0, 3)
    md = PagedAttentionMetadata(kv_lens=lens, block_tables=jnp.asarray(bt_np), cu_q_lens=cu, num_seqs=ns)
    return (q, k_pages, v_pages, md), (q.reshape(batch, length, HQ, D), kb, vb)


def run_prefill(batch, length, quick):
    paged, (qb, kb, vb) = prefill_problem(batch, length)
    flops = 4 * batch * HQ * D * length * length / 2
    scale = D**-0.5
    row = dict(batch=batch, length=length, flops=flops)
    variants = [dict(), dict(block_q=32, pages_per_block=8, num_warps=8, num_stages=2)]
    variants.append(dict(block_q=16, pages_per_block=4, num_warps=4, num_stages=3))
    if not quick:
        for bq, ppb, nw, st in [
            (32, 8, 8, 2),
            (16, 4, 4, 2),
            (32, 4, 8, 3),
            (16, 8, 4, 3),
            (32, 8, 8, 3),
            (16, 4, 4, 3),
        ]:
            variants.append(dict(block_q=bq, pages_per_block=ppb, num_warps=nw, num_stages=st))
    ours = {}
    for var in variants:
        f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, **var))
        t, err = try_bench(lambda f=f: f(*paged), [()])
        ours[json.dumps(var, sort_keys=True)] = t if t is not None else err
    good = {k: v for k, v in ours.items() if isinstance(v, float)}
    row["ours_default_s"] = ours.get("{}") if isinstance(ours.get("{}"), float) else None
    if good:
        best = min(good, key=good.get)
        row["ours_s"], row["ours_best_config"] = good[best], json.loads(best)
    row["ours_sweep"] = ours

    for impl in ("cudnn", "xla"):
        f = jax.jit(
            functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=scale, implementation=impl)
        )
        t, err = try_bench(f, [(qb, kb, vb)])
        row[f"{impl}_s"] = t
        if err:
            row[f"{impl}_error"] = err
    for key in ("ours", "cudnn", "xla"):
        t = row.get(f"{key}_s")
        row[f"{key}_tflops"] = flops / t / 1e12 if t else None
    return row


def run_kv_write(rows, pool_pages):
    k_pages = jax.random.normal(jax.random.key(1), (HKV, pool_pages, PS, D), DT)
    v_pages = jax.random.normal(jax.random.key(2), (HKV, pool_pages, PS, D), DT)
    k = jax.random.normal(jax.random.key(3), (rows, HKV, D), DT)
    v = jax.random.normal(jax.random.key(4), (rows, HKV, D), DT)
    slots = jnp.asarray(np.random.default_rng(0).permutation(pool_pages * PS)[:rows].astype(np.int32))
    res = dict(rows=rows, bytes=2 * rows * HKV * D * 2 * 2)
    for name, fn in (("xla", write_kv_cache_xla), ("pallas", write_kv_cache_pallas)):
        state = [k_pages, v_pages]

        def step(fn=fn, state=state):
            state[0], state[1] = fn(k, v, state[0], state[1], slots)
            return state[0]

        t, err = try_bench(step, [()])
        res[f"{name}_s"] = t
        if err:
            res[f"{name}_error"] = err
        k_pages, v_pages = state
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}-h200-kernels.json")
    ap.add_argument("--quick", action="store_true", help="defaults only, a few cases")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--contexts", default=None)
    ap.add_argument("--skip", default="", help="comma list of decode,prefill,kv_write")
    ap.add_argument("--cases", default=None, help="decode cases as b:ctx,b:ctx (overrides the grid)")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")] if args.batches else BATCHES
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else CONTEXTS
    skip = set(args.skip.split(",")) - {""}
    rng = np.random.default_rng(0)
    result = dict(
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        date=str(datetime.datetime.now(datetime.UTC)),
        shape=dict(hq=HQ, hkv=HKV, d=D, page_size=PS, dtype="bfloat16"),
        peak_tbps=PEAK_TBPS,
        decode=[],
        prefill=[],
        kv_write=[],
    )
    free = 120e9  # bytes we allow ourselves: paged pool + contiguous copy for XLA
    if "decode" not in skip:
        cases = [(b, c) for b in batches for c in contexts]
        if args.cases:
            cases = [tuple(int(x) for x in bc.split(":")) for bc in args.cases.split(",")]
        for b, c in cases:
            kv = b * c * HKV * D * 2 * 2
            if 2.5 * kv > free:
                result["decode"].append(dict(batch=b, context=c, skipped="does not fit"))
                continue
            t0 = time.time()
            row = run_decode(b, c, rng, args.quick)
            row["wall_s"] = time.time() - t0
            result["decode"].append(row)
            _save(args.out, result)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("sweep")}), flush=True)
    if "prefill" not in skip:
        for b, length in ((4, 2048), (1, 8192)):
            row = run_prefill(b, length, args.quick)
            result["prefill"].append(row)
            _save(args.out, result)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("sweep")}), flush=True)
    if "kv_write" not in skip:
        for rows in (64, 8192):
            row = run_kv_write(rows, 64 * 2048 // PS)
            result["kv_write"].append(row)
            print(json.dumps(row), flush=True)
    _save(args.out, result)
    print_table(result)


def _save(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def print_table(result):
    print(f"\n{result['device']}  jax {result['jax']}  peak ~{result['peak_tbps']} TB/s")
    print("decode (ms | TB/s effective)   ours(best)   ours(default)   jax-best   xla   ours/jax")
    for r in result["decode"]:
        if "skipped" in r:
            print(f"  b={r['batch']:<4} ctx={r['context']:<6} skipped: {r['skipped']}")
            continue
        d = r.get("ours_default_s")
        ratio = r["ours_tbps"] / r["jax_tbps"] if r.get("ours_tbps") and r.get("jax_tbps") else None
        print(
            f"  b={r['batch']:<4} ctx={r['context']:<6} "
            f"{_fmt(r.get('ours_s') and r['ours_s'] * 1e3)} | {_fmt(r.get('ours_tbps'), '{:.2f}')}   "
            f"{_fmt(d and r['kv_bytes'] / d / 1e12, '{:.2f}')}   "
            f"{_fmt(r.get('jax_s') and r['jax_s'] * 1e3)} | {_fmt(r.get('jax_tbps'), '{:.2f}')}   "
            f"{_fmt(r.get('xla_s') and r['xla_s'] * 1e3)} | {_fmt(r.get('xla_tbps'), '{:.2f}')}   "
            f"{_fmt(ratio, '{:.2f}x')}"
        )
    print("prefill (TFLOP/s)   ours(best)  ours(default)  cudnn  xla")
    for r in result["prefill"]:
        d = r.get("ours_default_s")
        print(
            f"  {r['batch']}x{r['length']}  {_fmt(r.get('ours_tflops'), '{:.0f}')}  "
            f"{_fmt(d and r['flops'] / d / 1e12, '{:.0f}')}  {_fmt(r.get('cudnn_tflops'), '{:.0f}')}  "
            f"{_fmt(r.get('xla_tflops'), '{:.0f}')}"
        )
    print("kv write (us)   xla-scatter   pallas")
    for r in result["kv_write"]:
        print(
            f"  rows={r['rows']:<5} {_fmt(r.get('xla_s') and r['xla_s'] * 1e6, '{:.1f}')}  "
            f"{_fmt(r.get('pallas_s') and r['pallas_s'] * 1e6, '{:.1f}')}"
        )


if __name__ == "__main__":
    main()
