"""One MoE layer's experts (layers/moe.py: sort by expert, two grouped GEMMs, weighted combine) per token
count, four ways: `jax.lax.ragged_dot` as lowered by default, ragged_dot through JAX's Pallas Triton
lowering (GPU only: `jax_ragged_dot_use_gpu_pallas_triton_lowering`), jaxllm's Pallas grouped GEMM
(kernels/grouped_matmul.py, what the models run on a GPU; interpreted on the CPU, so slow there), and a
dense einsum of every token through every expert, masked by the routing (what a grouped GEMM must beat).

    python -m benchmarks.moe_grouped_gemm --model qwen3-30b-a3b --tokens 1,8,32,256,2048
    python -m benchmarks.moe_grouped_gemm --model tiny-qwen3-moe --tokens 1,16 --dtype float32   # CPU check

Routing is uniform at random (K distinct experts per token). The bound per call is the larger of reading
the experts the batch touches (distinct experts x 3 H I weights) at the card's bandwidth and the routed
rows' FLOPs (2 x 3 H I per row) at its matmul rate.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.roofline import HARDWARE_CHOICES, dtype_bytes, kernel_hardware
from benchmarks.workload import arch_for_model, make_result, save_result
from jaxllm.layers.moe import moe_experts


def dense_experts(x, weights, ids, gate_up, down):  # every token through every expert, masked
    e = gate_up.shape[0]
    h = jnp.einsum("th,ehi->eti", x, gate_up, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.einsum(
        "eti,eih->eth", (jax.nn.silu(gate) * up).astype(x.dtype), down, preferred_element_type=jnp.float32
    )
    mix = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32) * weights[..., None], axis=1)  # f32[T, E]
    return jnp.einsum("eth,te->th", y, mix)


def timed(fn, *args, reps: int) -> tuple[float, jax.Array]:
    """(seconds per call, the output)."""
    first = jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps, first


def timed_or_failure(row: dict, name: str, fn, *args, reps: int) -> jax.Array | None:
    """row[NAME_ms] = the time, and the output is returned. A way that cannot run here is a finding, not
    the end of the sweep: row[NAME_ms] = None and row[NAME_error] = why (JAX 0.11.2's wheel lacks the module
    the Pallas Triton lowering imports; XLA's own ragged_dot on the GPU computes every row against every
    group and runs out of memory at thousands of tokens)."""
    try:
        seconds, out = timed(fn, *args, reps=reps)
    except (ImportError, jax.errors.JaxRuntimeError) as e:
        row[f"{name}_ms"] = None
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return None
    row[f"{name}_ms"] = seconds * 1e3
    return out


def cell(row: dict, name: str) -> str:
    ms = row[f"{name}_ms"]
    if ms is None:
        return f"{name} failed ({row[f'{name}_error']})"
    return f"{name} {ms:.3f} ms ({100 * row['bound_ms'] / ms:.0f}% of bound)"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,32,256,2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hardware", default="auto", choices=HARDWARE_CHOICES)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    arch, hw = arch_for_model(args.model), kernel_hardware(args.hardware)
    e, k, h, i = arch.num_experts, arch.num_experts_per_tok, arch.hidden_size, arch.moe_intermediate_size
    dtype, nbytes = jnp.dtype(args.dtype), dtype_bytes(args.dtype)
    key = jax.random.key(0)
    gate_up = (jax.random.normal(key, (e, h, 2 * i), jnp.float32) * 0.02).astype(dtype)
    down = (jax.random.normal(jax.random.fold_in(key, 1), (e, i, h), jnp.float32) * 0.02).astype(dtype)
    ways = {"ragged_dot": (False, False)}  # name -> (ragged_dot's Pallas lowering, jaxllm's kernel)
    if jax.default_backend() == "gpu":
        ways["ragged_dot_pallas"] = (True, False)
    ways["grouped_matmul_pallas"] = (False, True)
    rows = []
    for t in [int(s) for s in args.tokens.split(",")]:
        rng = np.random.default_rng(t)
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
        w = rng.uniform(size=(t, k)).astype(np.float32)
        x = jax.random.normal(jax.random.fold_in(key, t), (t, h), jnp.float32).astype(dtype)
        touched = len(np.unique(ids))
        bound = max(touched * 3 * h * i * nbytes / hw.bandwidth, 2 * 3 * h * i * t * k / hw.matmul_flops)
        row = {"tokens": t, "experts_touched": touched, "bound_ms": bound * 1e3}
        outs = {}
        for name, (pallas, kernel) in ways.items():
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", pallas)  # part of the jit key
            fn = jax.jit(
                lambda x, w, ids, gu, d, kernel=kernel: moe_experts(
                    x, w, ids, gu, d, jax.nn.silu, kernel=kernel
                )
            )
            outs[name] = timed_or_failure(
                row, name, fn, x, jnp.asarray(w), jnp.asarray(ids), gate_up, down, reps=args.reps
            )
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", False)
        dense = jax.jit(dense_experts)
        ref = timed_or_failure(
            row, "dense_einsum", dense, x, jnp.asarray(w), jnp.asarray(ids), gate_up, down, reps=args.reps
        )
        for name, out in outs.items():  # each grouped way computes what the dense one does
            if out is not None and ref is not None:
                scale = float(jnp.max(jnp.abs(ref))) or 1.0
                row[f"{name}_max_err_vs_dense"] = float(jnp.max(jnp.abs(out - ref))) / scale
        rows.append(row)
        cells = ", ".join(cell(row, n) for n in [*ways, "dense_einsum"])
        print(
            f"{args.model} experts, {t} tokens ({touched} experts touched), {args.dtype} on {jax.devices()[0].device_kind}: {cells}; bound ({hw.name}) {row['bound_ms']:.3f} ms"
        )
    result = make_result(
        "moe_grouped_gemm",
        f"{args.model}-moe-experts",
        args.model,
        vars(args),
        {"rows": rows},
        {"hardware": hw.name},
    )
    if not args.no_save:
        print(f"saved {save_result(result, args.output_json)}")
    return result


if __name__ == "__main__":
    main()
