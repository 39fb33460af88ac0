"""runs_w4a16_gemv: which served models get a decode bucket of one token (int4 codes on a GPU backend
without a mesh run the matrix-vector kernel at one row, jaxllm/layers/linear.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine.builder import runs_w4a16_gemv


def _params(qweight_dtype):
    layer = {"qweight": np.zeros((4, 8), qweight_dtype), "scales": np.ones((1, 8), np.float32)}
    return {"layers_0": {"mlp": {"down_proj": layer}}, "embed": {"embedding": np.zeros((16, 8), np.float32)}}


@pytest.mark.parametrize(
    "qweight_dtype, backend, mesh, expected",
    [
        (np.uint8, "pallas-hopper", None, True),  # int4 codes, two to a byte
        (np.uint8, "pallas", None, True),
        (np.uint8, "reference", None, False),  # the CPU path dequantizes, then dots
        (np.uint8, "pallas-hopper", "a mesh", False),  # a mesh dequantizes (linear.py)
        (np.int8, "pallas-hopper", None, False),  # W8A16 / W8A8 int8
        (jnp.float8_e4m3fn, "pallas-hopper", None, False),  # FP8
    ],
)
def test_only_int4_on_a_gpu_backend_without_a_mesh(qweight_dtype, backend, mesh, expected):
    assert runs_w4a16_gemv(_params(qweight_dtype), backend, mesh) is expected


def test_float_models_keep_their_buckets():
    params = {"layers_0": {"mlp": {"down_proj": {"kernel": np.zeros((4, 8), np.float32)}}}}
    assert runs_w4a16_gemv(params, "pallas-hopper", None) is False


def test_an_engine_with_the_one_token_bucket_decodes_one_sequence_there(
    tiny_llama_dir, jax_cache_dir, monkeypatch
):
    """The runner, scheduler and sampler at T = S = 1 (the bucket a 4-bit model gets on a GPU, forced here
    on the CPU): one decoding sequence runs its steps in it, and the tokens of greedy and seeded sampling
    match an engine without the bucket, alone and batched with others."""
    import jaxllm.engine.builder as builder
    from jaxllm import LLM, SamplingParams
    from jaxllm.runner.buckets import BucketPlan

    def llm():
        return LLM(tiny_llama_dir, dtype="float32", max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=64, compilation_cache_dir=jax_cache_dir)  # fmt: skip

    prompts = [[5, 9, 14, 3, 77, 21], [8, 8, 40], [101, 7]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
    ]

    def run(engine):
        alone = [engine.generate(None, p, prompt_token_ids=prompts[:1], use_tqdm=False) for p in params]
        batched = engine.generate(None, params[0], prompt_token_ids=prompts, use_tqdm=False)
        return [o[0].outputs[0].token_ids for o in alone], [o.outputs[0].token_ids for o in batched]

    want = run(llm())
    monkeypatch.setattr(builder, "runs_w4a16_gemv", lambda *args: True)
    engine = llm()
    assert engine.llm_engine.runner.plan.token_buckets[0] == 1
    shapes, original = [], BucketPlan.shape_for
    monkeypatch.setattr(
        BucketPlan, "shape_for", lambda self, *a: shapes.append(original(self, *a)) or shapes[-1]
    )
    assert run(engine) == want
    assert (1, 1) in {s[:2] for s in shapes}  # the single sequence decoded in the one-token bucket
