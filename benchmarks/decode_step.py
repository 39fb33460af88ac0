"""Decode-only engine steps against the memory-bandwidth bound: how close one forward pass gets to HBM.

    LLM(model, dummy weights) -> its ModelRunner -> for batch b x context c: a decode step's packed
    inputs (b sequences, each one new token at position c - 1 over c tokens of distinct KV pages)
    -> time the jitted model step (median of reps, after a warm-up compile) -> bytes it must move
    (weights + KV read) / the card's bandwidth = bound -> share of the bound achieved.

    python -m benchmarks.decode_step --model llama-3.1-8b --batches 1,32,256 --contexts 640,2048

The sampler (a few hundred microseconds) and the host's work per step are not in these times: this is the
forward pass alone, the part the kernels and XLA decide.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from benchmarks.roofline import (
    HARDWARE_CHOICES,
    decode_step_bytes,
    decode_step_seconds,
    kernel_hardware,
    shape_for_model,
)
from benchmarks.workload import make_result, save_result
from jaxllm.config import ATTENTION_BACKENDS

logger = logging.getLogger("jaxllm.benchmarks")


def decode_inputs(runner, batch: int, context: int):
    """Packed step inputs of a decode-only batch: sequence i owns pages 1 + i*P ... (page 0 is the null page)."""
    from jaxllm.runner.input_batch import empty_step_inputs

    bs = runner.block_size
    pages = -(-context // bs)
    if 1 + batch * pages > runner.num_blocks:
        raise ValueError(
            f"batch {batch} x context {context} needs {batch * pages + 1} KV blocks; the cache has {runner.num_blocks}"
        )
    inputs = empty_step_inputs(runner.plan.shape_for(batch, batch, pages))
    rows = np.arange(batch)
    tables = 1 + rows[:, None] * pages + np.arange(pages)[None, :]
    pos = context - 1
    inputs.block_tables[:batch, :pages] = tables
    inputs.input_ids[:batch] = (rows * 7919) % 1000 + 1
    inputs.positions[:batch] = pos
    inputs.slot_mapping[:batch] = tables[:, pos // bs] * bs + pos % bs
    inputs.kv_lens[:batch] = context
    inputs.cu_q_lens[1 : batch + 1] = rows + 1
    inputs.cu_q_lens[batch + 1 :] = batch
    inputs.num_seqs[0] = batch
    inputs.logits_indices[:batch] = rows
    inputs.num_tokens = batch
    return inputs


def randomize_kv(runner, seed: int = 0) -> None:
    """Fill the KV cache with random values (timing on zeros can flatter matrix units), layer by layer in place."""
    import jax

    @jax.jit
    def fill(key, like):
        return jax.random.normal(key, like.shape, like.dtype)

    key = jax.random.key(seed)
    for i, (k, v) in enumerate(runner.kv_caches):
        kk, kv = jax.random.split(jax.random.fold_in(key, i))
        runner.kv_caches[i] = (
            jax.device_put(fill(kk, k), k.sharding),
            jax.device_put(fill(kv, v), v.sharding),
        )
        jax.block_until_ready(runner.kv_caches[i])


def time_step(runner, inputs, reps: int) -> list[float]:
    import jax

    jax.block_until_ready(runner._run_model(inputs, all_logits=False))  # compile + warm-up
    jax.block_until_ready(runner._run_model(inputs, all_logits=False))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(runner._run_model(inputs, all_logits=False))
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--contexts", default="640,2048")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.8, help="leaves room to randomize the KV"
    )
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument(
        "--hardware",
        choices=HARDWARE_CHOICES,
        default="auto",
        help="peaks for the roofline (auto: this GPU's)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    from jaxllm import LLM

    max_len = max(contexts) + 16
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(max(batches), 16),
        gpu_memory_utilization=args.gpu_memory_utilization,
        compile_ahead=False,
        attention_backend=args.attention_backend,
    )
    runner = llm.llm_engine.runner
    randomize_kv(runner)
    shape = shape_for_model(args.model, args.dtype)
    hw = kernel_hardware(args.hardware)
    rows = []
    for c in contexts:
        for b in batches:
            try:
                times = time_step(runner, decode_inputs(runner, b, c), args.reps)
            except ValueError as e:
                logger.warning("skipped batch %d x context %d: %s", b, c, e)
                continue
            med = statistics.median(times)
            row = {"batch": b, "context": c, "median_s": med, "min_s": min(times), "tok_s": b / med}
            if shape is not None:
                bound = decode_step_seconds(shape, [c] * b, hw)
                row.update(
                    bytes=decode_step_bytes(shape, [c] * b),
                    bound_s=bound,
                    share_of_bound=bound / med,
                    achieved_tbps=decode_step_bytes(shape, [c] * b) / med / 1e12,
                )
            rows.append(row)
            logger.info(
                "batch %4d ctx %5d: %.3f ms  %s",
                b,
                c,
                med * 1e3,
                f"{row['share_of_bound']:.1%} of the {hw.name} bound ({row['bound_s'] * 1e3:.2f} ms)"
                if "share_of_bound" in row
                else "",
            )
    result = make_result(
        "decode_step",
        f"{args.model}-decode-steps",
        args.model,
        vars(args),
        {"steps": rows},
        {"hardware": hw.name, "bandwidth": hw.bandwidth} if shape is not None else None,
        startup=llm.llm_engine.startup_info,
    )
    if not args.no_save:
        path = save_result(result, args.output_json)
        logger.info("saved %s", path)
    print("| batch | context | step ms | bound ms | share | tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r['median_s'] * 1e3:.2f} | "
            f"{r.get('bound_s', float('nan')) * 1e3:.2f} | {r.get('share_of_bound', float('nan')):.1%} | {r['tok_s']:,.0f} |"
        )
    return result


if __name__ == "__main__":
    main()
