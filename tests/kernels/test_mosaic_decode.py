"""decode_paged_attention_mgpu (persistent Mosaic GPU decode kernel) against ref_ragged_paged_attention.

The shared tests (interpret mode, race detector, lowering for "cuda", the GPU runs) come from
checks.MosaicKernelTests; these are the decode kernel's cases and its own checks. On a GPU:
`pytest -m "gpu or not gpu" --gpu tests/kernels/test_mosaic_decode.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.mosaic_decode import DecodeMgpuConfig, decode_paged_attention_mgpu, decode_rows
from jaxllm.testing.kernel_cases import make_problem
from tests.kernels.checks import LowerCase, MosaicCase, MosaicKernelTests

C = DecodeMgpuConfig
LLAMA_LENS = (1, 15, 16, 17, 640, 1023, 2048, 77) * 5


class TestDecodeKernel(MosaicKernelTests):
    op = staticmethod(decode_paged_attention_mgpu)
    Config = DecodeMgpuConfig
    # Lengths 1, 3, 37, 129, 513, 1023 do not line up with pages or blocks; a few num_ctas make CTAs loop
    # over many units (the ring runs across them).
    CASES = [
        MosaicCase((1, 1, 1, 1), (1, 3, 70, 130), config=C(num_ctas=3)),
        MosaicCase(
            (1, 37, 1, 3), (1023, 37, 513, 40), heads=(6, 2), config=C(num_ctas=5)
        ),  # chunks: causal rows
        MosaicCase(
            (1,) * 5,
            (129, 1, 64, 65, 300),
            heads=(32, 8),
            d=128,
            config=C(num_ctas=7, block_kv=128, stages=2),
        ),
        MosaicCase((1, 2), (200, 7), jnp.float16, 8, (16, 1), config=C(num_ctas=1, stages=3)),  # R 16
        MosaicCase((1, 1), (500, 77), page_size=32, heads=(4, 4), d=256, config=C(stages=2)),  # MHA, d 256
    ]
    # Llama-3.1-8B heads, page 16: a ragged decode batch on the default grid, and with more units than
    # CTAs in every config benchmarks/decode_mgpu.py sweeps.
    LLAMA_CASES = [
        MosaicCase((1,) * len(LLAMA_LENS), LLAMA_LENS, heads=(32, 8), d=128, config=cfg)
        for cfg in (C(), C(stages=6), C(block_kv=128, stages=3), C(stages=2, num_ctas=264), C(num_ctas=16))
    ]
    RACE_CASES = [MosaicCase((1, 1, 2), (40, 131, 9), config=C(num_ctas=2, stages=2))]
    LOWER = [
        LowerCase(256, 256, 64, (32, 8), 128, 16),
        LowerCase(32, 32, 513, (32, 8), 128, 16, config=C(block_kv=128, stages=3)),
        LowerCase(64, 64, 64, (16, 2), 256, 16, config=C(stages=2)),
        LowerCase(8, 8, 64, (8, 8), 64, 8, config=C(pv_mode="smem")),
    ]
    BAD_INPUTS = [
        (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "dtype"),
        (lambda a: {**a, "k_pages": a["k_pages"][:, :, :4], "v_pages": a["v_pages"][:, :, :4]}, "page_size"),
        (lambda a: {**a, "config": C(block_kv=256, stages=4)}, "shared memory"),
    ]
    BAD_CONFIGS = [{"block_kv": 96}, {"stages": 1}, {"pv_mode": "tmem"}, {"num_ctas": 0}]


def test_decode_rows_by_hand():
    """Rows' block-table rows and visible keys: decode rows see their whole context, a 3-row chunk after
    10 tokens of context is causal (positions 10, 11, 12 see 11, 12, 13 keys), padding rows see none."""
    md = PagedAttentionMetadata(
        kv_lens=jnp.asarray([7, 13, 0], jnp.int32),
        block_tables=jnp.zeros((3, 1), jnp.int32),
        cu_q_lens=jnp.asarray([0, 1, 4, 4], jnp.int32),
        num_seqs=jnp.asarray([2], jnp.int32),
    )
    rows = np.asarray(decode_rows(md, 6))
    assert rows.tolist() == [[0, 1, 1, 1, 0, 0], [7, 11, 12, 13, 0, 0]]
    only = np.asarray(decode_rows(md, 6, only_decode=True))
    assert only.tolist() == [[0, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]]  # the chunk's rows go elsewhere


def test_rejects_too_many_heads_per_kv_head():
    prob = make_problem([1], [5], hq=128, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="query heads per KV head"):
        decode_paged_attention_mgpu(*prob.args(), sm_scale=0.125, interpret=True)
