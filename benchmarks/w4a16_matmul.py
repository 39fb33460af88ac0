"""The W4A16 GEMM (jaxllm/kernels/w4a16_matmul.py) against XLA on a layer's projection shapes, per token
count: the Pallas kernel on int4 weights, XLA's bf16 dot on dense weights, and XLA running the jnp
dequantize-then-dot on the same int4 weights (int4_reference.dequantize_int4, jitted), and XLA on the
codes held as its own 4-bit type u4 (dequantize-then-dot, and one dot per group scaled after it), to see
whether XLA's GEMM reads 4-bit weights in place; at up to eight tokens also the CUDA-core kernel
(jaxllm/kernels/w4a16_gemv.py; with --sweep or --sweep-gemv, its knobs too).

    python -m benchmarks.w4a16_matmul --model llama-3.1-8b --tokens 1,8,32,128
    python -m benchmarks.w4a16_matmul --sweep        # plus tiles around the default, one knob at a time

What is timed, as in gemm_shapes.py: one jitted function runs the product for L layers back to back, each
on its own weights and input (L x the weight bytes exceeds L2, so weights stream from HBM); time per
layer = median over --reps calls (after --warmup calls) of the wall time to block_until_ready / L.
Weights are random (codes: random bytes; scales and zeros bf16, group size --group-size, per channel
where it does not divide K). Reported per shape: microseconds per layer, the weight bytes read (int4:
codes + scales + zeros; bf16: 2 bytes per weight), their GB/s and the share of the card's bandwidth
bound (roofline.py's table, --hardware), and a device-to-device copy's bandwidth measured in the same
run for comparison. Before timing, the kernel's layer-0 output is checked against XLA's
dequantize-then-dot (max relative error; a row whose kernel fails to lower or compile records the error).

The kernel's correctness on a GPU is `pytest tests/kernels/test_w4a16_matmul.py --gpu`; this benchmark
checks each row's output as well, so a fast wrong kernel does not pass for a fast one.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemm_shapes import groups
from benchmarks.roofline import HARDWARE_CHOICES, kernel_hardware
from benchmarks.workload import arch_for_model, make_result, save_result
from jaxllm.compat import pipeline_named_triton_loops
from jaxllm.kernels.int4_reference import dequantize_int4, unpack_int4
from jaxllm.kernels.w4a16_gemv import MAX_ROWS as GEMV_MAX_ROWS
from jaxllm.kernels.w4a16_gemv import default_gemv_config, w4a16_gemv
from jaxllm.kernels.w4a16_matmul import default_config, w4a16_matmul

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def int4_bytes(k: int, n: int, g: int, scale_bytes: int = 2) -> int:
    """Bytes of one int4 weight: codes (half a byte each) plus a scale and a zero per group and column."""
    return k * n // 2 + 2 * (k // g) * n * scale_bytes


def make_layers(m: int, k: int, n: int, g: int, layers: int, seed: int = 0):
    """Per layer, made on the device: x bf16[m, k], int4 (qweight u8[k/2, n], scales, zeros bf16[k/g, n])
    and a dense bf16[k, n] weight."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + m + k + n), 5 * layers))
    xs, int4, dense = [], [], []
    for _ in range(layers):
        xs.append(jax.random.normal(next(keys), (m, k), jnp.float32).astype(jnp.bfloat16))
        qweight = jax.random.bits(next(keys), (k // 2, n), jnp.uint8)
        scales = jax.random.uniform(next(keys), (k // g, n), jnp.float32, 0.005, 0.015).astype(jnp.bfloat16)
        zeros = jax.random.uniform(next(keys), (k // g, n), jnp.float32, 0.0, 15.0).astype(jnp.bfloat16)
        int4.append((qweight, scales, zeros))
        dense.append((0.02 * jax.random.normal(next(keys), (k, n), jnp.float32)).astype(jnp.bfloat16))
    return xs, int4, dense


def kernel_fn(interpret: bool, knobs: dict):
    @jax.jit
    def run(xs, ws):
        return [w4a16_matmul(x, *w, interpret=interpret, **knobs) for x, w in zip(xs, ws, strict=True)]

    return run


def gemv_fn(interpret: bool, knobs: dict):
    pipeline_named_triton_loops()  # the `pipeline` knob's lowering hook, as the linear layer installs it

    @jax.jit
    def run(xs, ws):
        return [w4a16_gemv(x, *w, interpret=interpret, **knobs) for x, w in zip(xs, ws, strict=True)]

    return run


def gemv_knobs(m: int, k: int, n: int, g: int) -> list[dict]:
    """The GEMV kernel's default, then its knobs around it one at a time (program count, tile, warps)."""
    cfg = default_gemv_config(m, k, n, g)
    out = [{}]
    out += [{"block_n": bn} for bn in (64, 256) if n % bn == 0]
    out += [{"block_k": bk} for bk in (64,) if g % bk == 0 and bk != cfg["block_k"]]
    steps = k // cfg["block_k"]
    out += [{"split_k": sk} for sk in sorted({max(1, cfg["split_k"] // 2), min(steps, 2 * cfg["split_k"])})]
    out += [{"num_warps": w} for w in (2, 8)]
    out += [{"num_stages": 1}]
    out += [{"prefetch": not cfg["prefetch"]}, {"prefetch": not cfg["prefetch"], "num_warps": 2}]
    out += [{"pipeline": True, "num_stages": st} for st in (2, 3, 4)]
    out += [{"pipeline": True, "num_warps": w} for w in (2, 8)]
    return out


@jax.jit
def dense_dot(xs, ws):
    return [x @ w for x, w in zip(xs, ws, strict=True)]


@jax.jit
def xla_dequant_dot(xs, ws):
    return [x @ dequantize_int4(*w, dtype=x.dtype) for x, w in zip(xs, ws, strict=True)]


def as_uint4(int4_layers):
    """Per layer (codes as XLA's 4-bit type u4[K, N], scales, zeros): the same weights in the type XLA
    stores two to a byte and its GPU GEMM emitter can read in place, made once, outside the timing."""
    return [(unpack_int4(q).astype(jnp.uint4), s, z) for q, s, z in int4_layers]


@jax.jit
def xla_u4_dot(xs, ws):
    """x @ ((q - z) * s) from u4 codes, left for XLA to fuse: whether its GEMM reads the 4-bit weight in
    place (half a byte a weight) or materialises a dequantized copy first."""
    out = []
    for x, (q, s, z) in zip(xs, ws, strict=True):
        k, n = q.shape
        g = k // s.shape[0]
        w = (q.astype(x.dtype).reshape(k // g, g, n) - z[:, None, :]) * s[:, None, :]
        out.append(x @ w.reshape(k, n))
    return out


@jax.jit
def xla_u4_grouped_dot(xs, ws):
    """The same product as one dot per group, scaled after it: sum_g (x_g @ (q_g - z_g)) * s_g, so that
    the GEMM's operand is the converted code alone (a convert XLA fuses into its operand load) and the
    group scale multiplies a [K/g, M, N] float32 partial (small next to the weight at decode sizes)."""
    out = []
    for x, (q, s, z) in zip(xs, ws, strict=True):
        k, n = q.shape
        groups = s.shape[0]
        xg = x.reshape(x.shape[0], groups, k // groups).transpose(1, 0, 2)  # [G, M, g]
        part = jnp.einsum(
            "gmk,gkn->gmn", xg, q.astype(x.dtype).reshape(groups, k // groups, n),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        xsum = jnp.sum(xg.astype(jnp.float32), axis=2)  # [G, M]
        y = jnp.sum(part * s[:, None, :] - xsum[:, :, None] * (z * s)[:, None, :], axis=0)
        out.append(y.astype(x.dtype))
    return out


def time_per_layer(fn, xs, ws, warmup: int, reps: int) -> float:
    """Seconds per layer: median over reps of one call over every layer, after warm-up calls."""
    jax.block_until_ready(fn(xs, ws))
    for _ in range(warmup):
        jax.block_until_ready(fn(xs, ws))
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(xs, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(xs)


def copy_bandwidth(mb: int, reps: int) -> float:
    """Bytes/s of a device-to-device elementwise copy (read + write) of `mb` MiB."""
    a = jnp.zeros((mb * 2**20 // 4,), jnp.uint32)
    f = jax.jit(lambda a: a + 1)
    jax.block_until_ready(f(a))
    times = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(times)


def measure(seconds: float, nbytes: int, bandwidth: float) -> dict:
    return {
        "us": seconds * 1e6,
        "weight_bytes": nbytes,
        "gbps": nbytes / seconds / 1e9,
        "bound_share": nbytes / bandwidth / seconds,
    }


def max_rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def sweep_knobs(m: int, k: int, n: int, g: int) -> list[dict]:
    """Tiles around the default, one knob at a time (the default first)."""
    cfg = default_config(m, k, n, g)
    out = [{}]
    for bn in (64, 128, 256):
        if bn != cfg["block_n"] and n % bn == 0:
            out.append({"block_n": bn})
    for bk in (128, 256, 512):
        if bk != cfg["block_k"] and k % bk == 0 and (g % bk == 0 or bk % g == 0):
            out.append({"block_k": bk})
    steps = k // cfg["block_k"]
    for sk in {1, max(1, cfg["split_k"] // 2), min(steps, 2 * cfg["split_k"])} - {cfg["split_k"]}:
        out.append({"split_k": sk})
    out += [{"num_warps": 8 if cfg["num_warps"] == 4 else 4}]
    out += [{"num_stages": s} for s in (2, 3, 4, 5) if s != cfg["num_stages"]]
    return out


def bench_row(name, m, k, n, g, args, bandwidth) -> dict:
    row = {"tokens": m, "group": name, "k": k, "n": n, "group_size": g, "config": default_config(m, k, n, g)}
    xs, int4, dense = make_layers(m, k, n, g, args.layers)
    bf16_bytes, q_bytes = 2 * k * n, int4_bytes(k, n, g)
    row["bf16_dot"] = measure(
        time_per_layer(dense_dot, xs, dense, args.warmup, args.reps), bf16_bytes, bandwidth
    )
    row["xla_dequant_dot"] = measure(
        time_per_layer(xla_dequant_dot, xs, int4, args.warmup, args.reps), q_bytes, bandwidth
    )
    ref = xla_dequant_dot(xs[:1], int4[:1])[0]
    u4 = as_uint4(int4)
    for label, fn in (("xla_u4_dot", xla_u4_dot), ("xla_u4_grouped_dot", xla_u4_grouped_dot)):
        try:  # XLA's own reading of 4-bit weights, beside the kernel (each checked against the reference)
            row[label] = measure(time_per_layer(fn, xs, u4, args.warmup, args.reps), q_bytes, bandwidth)
            row[label]["max_rel_err_vs_xla"] = max_rel_err(fn(xs[:1], u4[:1])[0], ref)
        except Exception as e:  # noqa: BLE001 - a way XLA cannot compile here is recorded, not fatal
            row[label] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    del u4
    if m <= GEMV_MAX_ROWS:  # the CUDA-core kernel for a handful of rows (w4a16_gemv.py), its knobs swept
        ways = []
        for knobs in gemv_knobs(m, k, n, g) if args.sweep or args.sweep_gemv else [{}]:
            entry = {"knobs": knobs}
            try:
                fn = gemv_fn(args.interpret, knobs)
                entry["max_rel_err_vs_xla"] = max_rel_err(fn(xs[:1], int4[:1])[0], ref)
                entry.update(
                    measure(time_per_layer(fn, xs, int4, args.warmup, args.reps), q_bytes, bandwidth)
                )
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                entry["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            ways.append(entry)
        row["w4a16_gemv"] = ways[0]
        timed = [e for e in ways if "us" in e]
        if len(ways) > 1:
            row["gemv_sweep"] = ways
            if timed:
                row["gemv_best"] = min(timed, key=lambda e: e["us"])
    candidates = sweep_knobs(m, k, n, g) if args.sweep else [{}]
    tried = []
    for knobs in candidates:
        entry = {"knobs": knobs}
        try:
            fn = kernel_fn(args.interpret, knobs)
            entry["max_rel_err_vs_xla"] = max_rel_err(fn(xs[:1], int4[:1])[0], ref)
            entry.update(measure(time_per_layer(fn, xs, int4, args.warmup, args.reps), q_bytes, bandwidth))
        except Exception as e:  # noqa: BLE001 - a knob set that fails to lower/compile is recorded, not fatal
            entry["error"] = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            )
            if args.verbose:
                traceback.print_exc()
        tried.append(entry)
    row["w4a16"] = tried[0]
    timed = [e for e in tried if "us" in e]
    if args.sweep:
        row["sweep"] = tried
        if timed:
            row["best"] = min(timed, key=lambda e: e["us"])
    if "us" in row["w4a16"]:
        row["speedup_vs_bf16_dot"] = row["bf16_dot"]["us"] / row["w4a16"]["us"]
        row["speedup_vs_xla_dequant_dot"] = row["xla_dequant_dot"]["us"] / row["w4a16"]["us"]
    return row


def describe(row) -> str:
    def cell(label, e):
        if "error" in e:
            return f"{label} ERROR {e['error'][:80]}"
        return f"{label} {e['us']:8.1f} us {e['gbps']:7.0f} GB/s ({100 * e['bound_share']:3.0f}% of bound)"

    cells = [cell("w4a16", row["w4a16"])]
    labels = ("w4a16_gemv", "bf16_dot", "xla_dequant_dot", "xla_u4_dot", "xla_u4_grouped_dot")
    cells += [cell(lab, row[lab]) for lab in labels if lab in row]
    text = f"M={row['tokens']:>4} {row['group']:<8} K={row['k']:>5} N={row['n']:>5}  " + " | ".join(cells)
    if "max_rel_err_vs_xla" in row["w4a16"]:
        text += f" | err {row['w4a16']['max_rel_err_vs_xla']:.1e}"
    if "speedup_vs_bf16_dot" in row:
        text += f" | x{row['speedup_vs_bf16_dot']:.2f} vs bf16"
    if "best" in row:
        text += f" | best {row['best']['us']:.1f} us {row['best']['knobs']}"
    if "gemv_best" in row:
        text += f" | gemv best {row['gemv_best']['us']:.1f} us {row['gemv_best']['knobs']}"
    return text


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="llama-3.1-8b", help="preset or HF folder whose projection shapes to use"
    )
    p.add_argument("--tokens", default="1,8,32,128", help="token counts (the GEMMs' M), comma list")
    p.add_argument(
        "--group-size", type=int, default=128, help="quantization group (per channel if it does not divide K)"
    )
    p.add_argument("--layers", type=int, default=8, help="layers per timed call, each with its own weights")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--sweep", action="store_true", help="also time tiles around the default, one knob at a time"
    )
    p.add_argument("--sweep-gemv", action="store_true", help="sweep the GEMV kernel's knobs only")
    p.add_argument("--copy-mb", type=int, default=1024, help="size of the measured device copy (0: skip)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
    p.add_argument(
        "--hardware", choices=HARDWARE_CHOICES, default="auto", help="peaks for the bound (auto: this GPU's)"
    )
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing configs")
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    arch, hw = arch_for_model(args.model), kernel_hardware(args.hardware)
    copy_bps = copy_bandwidth(args.copy_mb, args.reps) if args.copy_mb > 0 else None
    print(f"device {jax.devices()[0].device_kind}; bound: {hw.name} at {hw.bandwidth / 1e12:.2f} TB/s"
          + (f"; measured copy {copy_bps / 1e12:.2f} TB/s" if copy_bps else ""), flush=True)  # fmt: skip
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        for name, (k, widths) in groups(arch).items():
            n = sum(widths)  # the model's fused weight (q|k|v, gate|up)
            g = args.group_size if k % args.group_size == 0 else k
            rows.append(bench_row(name, m, k, n, g, args, hw.bandwidth))
            print(describe(rows[-1]), flush=True)
    result = make_result(
        "w4a16_matmul", f"w4a16-matmul-{args.model}", args.model, vars(args), {"rows": rows},
        {"hardware": hw.name, "bandwidth": hw.bandwidth, "copy_bandwidth": copy_bps},
        devices=[str(d) for d in jax.devices()], jax_version=jax.__version__,
    )  # fmt: skip
    if not args.no_save:
        print("saved", save_result(result, args.output_json))
    return result


if __name__ == "__main__":
    main()
