"""Start-up cost of the attention ops per step variant: trace + lower, then compile (or load from the
persistent compilation cache), for the Triton op (pallas) and the Hopper op at a few bucket shapes.

    python -m benchmarks.op_load_time /tmp/cache-dir     # twice: the first run fills the cache (cold),
                                                         # the second reads it (warm)

Lowering runs in Python under the GIL on every start, cache or not, so it adds up over a server's step
variants; the compile column is what the persistent cache saves. Needs a GPU (the kernels lower for it).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp

from jaxllm.kernels.metadata import PagedAttentionMetadata

SHAPES = [(256, 256), (1024, 1024), (2048, 256), (8192, 1024)]  # (T, S) buckets; tables 64 pages wide


def op_args(t: int, s: int, b: int = 64):
    sds = jax.ShapeDtypeStruct
    q = sds((t, 32, 128), jnp.bfloat16)  # Llama-3.1-8B heads, page 16
    kv = sds((8, 8192, 16, 128), jnp.bfloat16)
    md = PagedAttentionMetadata(
        kv_lens=sds((s,), jnp.int32),
        block_tables=sds((s, b), jnp.int32),
        cu_q_lens=sds((s + 1,), jnp.int32),
        num_seqs=sds((1,), jnp.int32),
    )
    return q, kv, kv, md


def main(cache_dir: str) -> list[dict]:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jaxllm.kernels import ops as gpu_ops

    rows = []
    for name, op in [
        ("pallas", gpu_ops.ragged_paged_attention),
        ("hopper", gpu_ops.ragged_paged_attention_hopper),
    ]:
        for t, s in SHAPES:
            f = jax.jit(lambda *a, op=op: op(*a, sm_scale=0.1))
            t0 = time.perf_counter()
            lowered = f.trace(*op_args(t, s)).lower()
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            rows.append(dict(op=name, t=t, s=s, lower_s=round(t1 - t0, 3), compile_s=round(t2 - t1, 3)))
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
