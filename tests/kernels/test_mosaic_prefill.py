"""prefill_paged_attention_mgpu (Mosaic GPU) against ref_ragged_paged_attention (plain jnp, f32 softmax).

The shared tests (interpret mode, race detector, lowering for "cuda", the GPU runs) come from
checks.MosaicKernelTests; these are the prefill kernel's cases and its own checks. On a GPU:
`pytest -m "gpu or not gpu" --gpu tests/kernels/test_mosaic_prefill.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxllm.kernels.mosaic_prefill import MgpuConfig, prefill_paged_attention_mgpu
from jaxllm.testing.kernel_cases import make_problem
from tests.kernels.checks import LowerCase, MosaicCase, MosaicKernelTests

C = MgpuConfig

# kv_len > q_len: context before the chunk. Lengths 3, 37, 300, 513, 1023 do not line up with pages or
# tiles. num_ctas below the unit count makes CTAs loop over several units (the persistent path).
CASES = [
    MosaicCase((128, 256), (128, 256), aligned=True),
    MosaicCase((128, 256), (300, 256), heads=(4, 1), d=128, config=C(num_ctas=3), aligned=True),
    MosaicCase((3, 40), (3, 40), heads=(4, 4)),
    MosaicCase((64,), (513,), jnp.float16, 32, (8, 2), config=C(num_ctas=2)),
    MosaicCase((1, 37, 1, 3), (1023, 37, 513, 40), heads=(6, 2), config=C(num_ctas=5)),
    MosaicCase((200, 130), (1000, 130), jnp.float16, 64, (4, 2), 128, C(block_kv=64, stages=3)),
    MosaicCase((300,), (700,), heads=(2, 1), config=C(schedule_barrier=False, num_ctas=1)),
    MosaicCase(
        (300, 200),
        (700, 200),
        page_size=8,
        heads=(2, 2),
        config=C(q_buffers=1, longest_first=False, num_ctas=3),
    ),
    MosaicCase((130, 70), (500, 70), heads=(2, 1), d=256, config=C(block_kv=64, q_buffers=1, num_ctas=2)),
    MosaicCase(
        (256,), (256,), jnp.float16, 128, (2, 1), config=C(stages=4, q_buffers=1, num_ctas=2), aligned=True
    ),
    # Many one- or two-block units in one CTA, each with a page tail, warpgroups not in lockstep.
    MosaicCase((3, 5, 7, 2), (131, 133, 7, 150), heads=(2, 1), config=C(schedule_barrier=False, num_ctas=1)),
]


class TestPrefillKernel(MosaicKernelTests):
    op = staticmethod(prefill_paged_attention_mgpu)
    Config = MgpuConfig
    CASES = CASES
    # Llama-3.1-8B heads (32 q / 8 kv, d 128), page 16: two 1024-token prompts and a chunk with context.
    LLAMA_CASES = [
        MosaicCase((1024, 1024), (1024, 1024), heads=(32, 8), d=128, aligned=True),
        MosaicCase((512, 77), (2000, 77), heads=(32, 8), d=128),
    ]
    RACE_CASES = [CASES[1], CASES[4]]
    WRONG_ANSWER = MosaicCase((130,), (300,), jnp.float16, heads=(2, 1))
    LOWER = [
        LowerCase(8192, 4, 128, (32, 8), 128, 16, aligned=True),
        LowerCase(8192, 1, 512, (32, 8), 128, 16, config=C(block_kv=64, stages=3), aligned=True),
        LowerCase(1000, 2, 57, (32, 8), 128, 16, jnp.float16, C(stages=3, q_buffers=1)),
        LowerCase(1000, 2, 29, (8, 2), 64, 32, config=C(schedule_barrier=False, persistent=False)),
        LowerCase(1000, 2, 15, (8, 2), 256, 64),
        LowerCase(128, 1, 16, (8, 2), 128, 8, config=C(pv_mode="smem"), aligned=True),
    ]
    BAD_INPUTS = [
        (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "dtype"),
        (lambda a: {**a, "k_pages": a["k_pages"][:, :, :4], "v_pages": a["v_pages"][:, :, :4]}, "page_size"),
        (lambda a: {**a, "config": C(block_kv=256, stages=3)}, "shared memory"),
        (lambda a: {**a, "min_q_len": 0}, "min_q_len"),
    ]
    BAD_CONFIGS = [{"block_q": 128}, {"block_kv": 96}, {"stages": 1}, {"pv_mode": "tmem"}, {"q_buffers": 3}]

    def op_kwargs(self, case) -> dict:
        return {"q_tile_aligned": case.aligned}


def test_aligned_precondition_is_checked():
    prob = make_problem([100, 156], [100, 156], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="q_tile_aligned"):
        prefill_paged_attention_mgpu(*prob.args(), sm_scale=0.125, q_tile_aligned=True, interpret=True)
