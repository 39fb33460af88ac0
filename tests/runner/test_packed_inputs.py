"""The packed step buffer: every field is a view of the one buffer at an offset that is a multiple of
256 bytes (what Mosaic GPU kernels need of their operands), and unpack (as the jitted step
slices it) returns the same arrays the host filled."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner.input_batch import empty_step_inputs, packed_layout, unpack


@pytest.mark.parametrize("shape", [(8, 8, 1), (24, 3, 5), (2048, 256, 41)])
def test_fields_are_aligned_views_that_unpack_back(shape):
    x = empty_step_inputs(shape)
    base = x.packed.__array_interface__["data"][0]
    rng = np.random.default_rng(0)
    for name, _, shp in packed_layout(*shape):
        view = getattr(x, name)
        assert view.shape == shp and view.base is not None
        assert (view.__array_interface__["data"][0] - base) % 256 == 0, name
        view[...] = rng.integers(-5, 1000, shp)
    on_device = unpack(jnp.asarray(x.packed), shape)
    for name, _, _ in packed_layout(*shape):
        np.testing.assert_array_equal(np.asarray(on_device[name]), getattr(x, name), err_msg=name)
