"""The W8A8 projection (jaxllm/layers/linear.py quantized_matmul) against XLA's bf16 dot on a layer's
projection shapes, per token count, and which GEMM XLA compiled each one to.

    python -m benchmarks.w8a8_gemm --model llama-3.1-8b --tokens 1,16,64,256,2048 --kinds fp8,int8

Why: the W8A8 layer is only worth its name where XLA's GPU compiler turns the 8-bit dot into cuBLASLt's
FP8 (or int8) GEMM. It does so for f8 x f8 -> f32 dots, but cuBLASLt takes both operands with K
contiguous, so a weight stored [K, N] costs a transpose of the weight on every call (slower than bf16);
the layer keeps its weight [N, K] (scheme.py) for that reason. This benchmark shows per shape what the
compiled module calls ("cublas$lt$matmul$f8", a Triton fusion, ...) beside its time.

Timed, as in gemm_shapes.py: one jitted function runs the product for L layers back to back, each on its
own weights and input (L x the weight bytes exceeds L2, so weights stream from HBM); time per layer =
median over --reps calls of the wall time to block_until_ready / L. bf16: x @ w [K, N]. W8A8: the layer's
whole path (per-token activation quantization, the 8-bit dot, both scales), on weights quantized from the
same bf16 ones (quantize.py); "-weight-only": the layer's decode-batch path (activations unquantized, the
8-bit weight converted inside the GEMM). Before timing, layer 0's output is checked against the plain-jnp
dequantize-then-dot reference (max relative error).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.gemm_shapes import groups
from benchmarks.roofline import HARDWARE_CHOICES, kernel_hardware
from benchmarks.workload import arch_for_model, make_result, save_result
from jaxllm.layers.linear import dequantize, quantized_matmul
from jaxllm.quantization.quantize import quantize_fp8, quantize_int8
from jaxllm.quantization.scheme import QuantScheme

SCHEMES = {
    "fp8": QuantScheme(method="fp8", weights="fp8", activations="fp8"),
    "int8": QuantScheme(method="compressed-tensors", weights="int8", activations="int8"),
}
# "<kind>-weight-only": the same leaves, activations left unquantized (what decode batches run on the GPU)
KINDS = [*SCHEMES, *(f"{k}-weight-only" for k in SCHEMES)]
GEMM_CALLS = ("cublas$lt$matmul$f8", "cublas$lt$matmul", "cublas$gemm", "__triton_gemm", "triton")


def gemm_kinds(compiled_text: str) -> list[str]:
    """The GEMM implementations a compiled module's text names, most specific first."""
    found = []
    for key in GEMM_CALLS:
        if key in compiled_text and not any(key in f for f in found):
            found.append(key)
    return found


def layer(stacked: dict, i: int) -> dict:
    """Layer i's leaves out of leaves stacked along a leading layer axis."""
    return {name: a[i] for name, a in stacked.items()}


def _time(fn, args, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(k: int, n: int, m: int, kind: str, layers: int, warmup: int, reps: int, seed: int = 0) -> dict:
    weight_only = kind.endswith("-weight-only")
    base = kind.removesuffix("-weight-only")
    scheme = SCHEMES[base]
    key = jax.random.key(seed)
    kx, kw = jax.random.split(key)
    xs = jax.random.normal(kx, (layers, m, k), jnp.float32).astype(jnp.bfloat16)
    ws = (jax.random.normal(kw, (layers, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    quantize = quantize_fp8 if base == "fp8" else (lambda w: quantize_int8(w, w8a8=True))
    qs = jax.vmap(quantize)(ws)  # each leaf with a leading layer axis

    def dense_all(xs, ws):
        return [xs[i] @ ws[i] for i in range(layers)]

    def quant_all(xs, qs):
        return [
            quantized_matmul(xs[i], layer(qs, i), scheme, w8a8_weight_only=weight_only) for i in range(layers)
        ]

    # compiled once: the same executables are checked, timed and named by the GEMM they call
    dense_fn = jax.jit(dense_all).lower(xs, ws).compile()
    quant_fn = jax.jit(quant_all).lower(xs, qs).compile()
    q0 = layer(qs, 0)
    ref = jnp.dot(xs[0].astype(jnp.float32), dequantize(q0, scheme, jnp.float32))
    got = quant_fn(xs, qs)[0].astype(jnp.float32)
    rel_err = float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
    t_dense = _time(dense_fn, (xs, ws), warmup, reps) / layers
    t_quant = _time(quant_fn, (xs, qs), warmup, reps) / layers
    return {
        "k": k, "n": n, "tokens": m, "kind": kind,
        "bf16_us": t_dense * 1e6, "w8a8_us": t_quant * 1e6, "speedup": t_dense / t_quant,
        "bf16_weight_tb_s": 2 * k * n / t_dense / 1e12, "w8a8_weight_tb_s": k * n / t_quant / 1e12,
        "w8a8_gemm": gemm_kinds(quant_fn.as_text()),
        "bf16_gemm": gemm_kinds(dense_fn.as_text()),
        "max_rel_err_vs_dequantized": rel_err,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", default="1,16,64,256,2048")
    p.add_argument("--kinds", default="fp8,int8", help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument(
        "--shapes", default=None, help="comma-separated KxN (default: every projection of the model)"
    )
    p.add_argument("--layers", type=int, default=8, help="layers per timed call (weights stream from HBM)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hardware", default="auto", choices=HARDWARE_CHOICES)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    arch = arch_for_model(args.model)
    shapes = sorted({(k, n) for k, widths in groups(arch).values() for n in [sum(widths)]})
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        for k, n in shapes:
            for m in (int(t) for t in args.tokens.split(",")):
                row = measure(k, n, m, kind, args.layers, args.warmup, args.reps)
                rows.append(row)
                print(
                    f"{kind} K={k} N={n} M={m}: bf16 {row['bf16_us']:.0f} us, W8A8 {row['w8a8_us']:.0f} us "
                    f"({row['speedup']:.2f}x) via {','.join(row['w8a8_gemm']) or '?'}; "
                    f"rel err {row['max_rel_err_vs_dequantized']:.1e}",
                    flush=True,
                )
    hw = kernel_hardware(args.hardware)
    result = make_result(
        "w8a8_gemm", f"w8a8-gemm-{args.model}", args.model, vars(args), {"rows": rows},
        {"hardware": hw.name},
    )  # fmt: skip
    if not args.no_save:
        print("saved", save_result(result, args.output_json))
    return result


if __name__ == "__main__":
    main()
