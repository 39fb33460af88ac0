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
