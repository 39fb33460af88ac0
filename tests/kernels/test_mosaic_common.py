"""The pieces of mosaic_common.py that run outside a kernel, checked by hand."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxllm.kernels.mosaic_common import unit_schedule


@pytest.mark.parametrize("num_units, grid", [(1, 1), (7, 3), (9, 3), (12, 5), (264, 132), (300, 132), (5, 8)])
def test_unit_schedule_covers_every_unit_once(num_units, grid):
    grid = min(grid, num_units)
    seen = []
    for pid in range(grid):
        count, unit_of = unit_schedule(jnp.int32(pid), num_units, grid)
        seen += [int(unit_of(jnp.int32(k))) for k in range(int(count))]
    assert sorted(seen) == list(range(num_units))


def test_unit_schedule_deals_rounds_in_snake_order():
    """Round 0 ascending, round 1 descending: CTA 0 gets units 0 and 5 of 6 over 3 CTAs."""
    units = [[int(unit_schedule(jnp.int32(p), 6, 3)[1](jnp.int32(k))) for k in range(2)] for p in range(3)]
    assert units == [[0, 5], [1, 4], [2, 3]]
