"""The projection GEMMs of one decoder layer, with separate weights (as checkpoints hold them) and with
fused ones (q|k|v in one [H, (Nq + 2 Nkv) D] weight, gate|up in one [H, 2 I]: the model's layout since
models/fused_projections.py), at given token counts.
The fused weight is the separate ones side by side; its product is checked against theirs.

    python -m benchmarks.gemm_shapes --model llama-3.1-8b --tokens 1,32,1000,16384

What is timed: one jitted function runs the group for L layers, each on its own weights and its own
input (so no weight stays in L2 and XLA cannot merge dots across layers), bf16 in and out; time per
layer = median wall time of --reps calls / L. Separate q, k and v are three dots on one input, which XLA
may merge on its own (its dot merger): the comparison is what the model's layout gives against one
fused weight. Reported per group: ms per layer, TFLOP/s, and the weight bytes' TB/s, against the card's
matmul rate and bandwidth (roofline.py, --hardware), and fused / separate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.roofline import HARDWARE_CHOICES, kernel_hardware
from benchmarks.workload import arch_for_model, make_result, save_result


def groups(arch) -> dict[str, tuple[int, list[int]]]:
    """Group name -> (input width, output widths of its dots)."""
    h, d = arch.hidden_size, arch.head_dim
    return {
        "qkv": (h, [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]),
        "o": (arch.num_heads * d, [h]),
        "gate_up": (h, [arch.intermediate_size, arch.intermediate_size]),
        "down": (arch.intermediate_size, [h]),
    }


def make_inputs(m: int, k: int, widths: list[int], layers: int):
    """Per layer: an input [m, k] and the group's separate weights [k, n] (bf16, seeded)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(m + k + sum(widths)), layers * (len(widths) + 1)))

    def normal(shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(jnp.bfloat16)

    xs = [normal((m, k)) for _ in range(layers)]
    ws = [[normal((k, n)) for n in widths] for _ in range(layers)]
    return xs, ws


@jax.jit
def _products(xs, ws):
    return [[x @ w for w in wl] for x, wl in zip(xs, ws, strict=True)]


def time_group(xs, ws, reps: int) -> float:
    """Seconds per layer of the dots `ws` (per layer, a list of weights) on the inputs `xs`."""
    jax.block_until_ready(_products(xs, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(_products(xs, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(xs)


def fused_matches(xs, ws, fused) -> float:
    """Largest |fused - separate| over layer 0's outputs (the fused weight is the separate ones side by
    side, so its product is theirs side by side)."""
    sep = jnp.concatenate(_products(xs[:1], ws[:1])[0], axis=1).astype(jnp.float32)
    one = _products(xs[:1], fused[:1])[0][0].astype(jnp.float32)
    return float(jnp.max(jnp.abs(sep - one)))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", default="1,32,1000,16384", help="token counts (the GEMMs' M), comma list")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--hardware", choices=HARDWARE_CHOICES, default="auto", help="peaks for the bound (auto: this GPU's)"
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    arch, hw = arch_for_model(args.model), kernel_hardware(args.hardware)
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        for name, (k, widths) in groups(arch).items():
            row = {"tokens": m, "group": name, "k": k, "widths": widths}
            xs, ws = make_inputs(m, k, widths, args.layers)
            candidates = {"separate": ws}
            if len(widths) > 1:
                candidates["fused"] = [[jnp.concatenate(wl, axis=1)] for wl in ws]
                row["fused_max_abs_diff"] = fused_matches(xs, ws, candidates["fused"])
            for label, weights in candidates.items():
                s = time_group(xs, weights, args.reps)
                flops = 2 * m * k * sum(widths)
                wbytes = 2 * k * sum(widths)
                row[label] = {
                    "ms": s * 1e3,
                    "tflops": flops / s / 1e12,
                    "weight_tbps": wbytes / s / 1e12,
                    "bound_share": max(flops / hw.matmul_flops, wbytes / hw.bandwidth) / s,
                }
            del xs, ws, candidates
            if "fused" in row:
                row["fused_over_separate"] = row["fused"]["ms"] / row["separate"]["ms"]
            rows.append(row)
            cells = " ".join(
                f"{lab} {row[lab]['ms']:.3f} ms ({row[lab]['tflops']:.0f} TFLOP/s, "
                f"{row[lab]['weight_tbps']:.2f} TB/s, {100 * row[lab]['bound_share']:.0f}% of bound)"
                for lab in ("separate", "fused")
                if lab in row
            )
            ratio = f"  fused/separate {row['fused_over_separate']:.3f}" if "fused" in row else ""
            print(f"M={m:>6} {name:<8} {cells}{ratio}", flush=True)
    result = make_result(
        "gemm_shapes", f"gemm-shapes-{args.model}", args.model, vars(args), {"rows": rows}, None,
        devices=[str(d) for d in jax.devices()],
    )  # fmt: skip
    if not args.no_save:
        print("saved", save_result(result, args.output_json))
    return result


if __name__ == "__main__":
    main()
