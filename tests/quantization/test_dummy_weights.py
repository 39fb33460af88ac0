"""Random weights in each quantized layout (load_format="dummy") stand for w ~ 0.02 like the float ones,
so that a random model at real sizes keeps finite, realistically sized activations in every format."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.linear import dequantize
from jaxllm.loader.dummy import dummy_params
from jaxllm.quantization.scheme import QuantScheme

K, N = 512, 256
SCHEMES = {
    "int4 g128": QuantScheme("awq", "int4", group_size=128),
    "int8 W8A16": QuantScheme("t", "int8"),
    "fp8 W8A16": QuantScheme("t", "fp8"),
    "int8 W8A8 static": QuantScheme("t", "int8", "int8", static_input_scale=True),
    "fp8 W8A8": QuantScheme("fp8", "fp8", "fp8", online=True),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_dummy_quantized_layer_has_float_spread(name):
    scheme = SCHEMES[name]
    abstract = {
        "layers_0": {
            "mlp": {
                "down_proj": {
                    leaf: jax.ShapeDtypeStruct(shape, jnp.float32 if dt == "float32" else dt)
                    for leaf, (shape, dt) in scheme.param_shapes(K, N, "float32").items()
                }
            }
        }
    }
    params = dummy_params(abstract, seed=1)["layers_0"]["mlp"]["down_proj"]
    for leaf, s in abstract["layers_0"]["mlp"]["down_proj"].items():
        assert params[leaf].shape == s.shape and params[leaf].dtype == s.dtype, leaf
    w = np.asarray(dequantize(params, scheme, jnp.float32))
    assert np.all(np.isfinite(w))
    assert 0.015 < w.std() < 0.025, w.std()  # the float kernels' N(0, 0.02^2)
    if scheme.static_input_scale:  # activations of a few units neither vanish nor all saturate
        assert 1 / 127 < float(params["input_scale"]) < 1.0
