"""The step's index computations have no XLA while loop: on a GPU a while loop reads its condition back to
the host every iteration, so one inside the step blocks its dispatch until the device gets there (the host
can no longer run ahead of the device). `jnp.searchsorted`'s default binary search is such a loop (a
`scan` of log2 steps), so the step's index lookups are vectorised compares instead."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.grouped_matmul import group_metadata
from jaxllm.models.llama import sequence_lengths

LOOPS = {"while", "scan"}  # the primitives XLA lowers to a while loop


def primitives(jaxpr) -> set[str]:
    """Every primitive of a closed jaxpr, nested jaxprs (pjit, custom_jvp, ...) included."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
    seen = set()
    for eqn in inner.eqns:
        seen.add(eqn.primitive.name)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            seen |= primitives(sub)
    return seen


def test_primitives_sees_a_searchsorted_loop():  # the check itself can fail
    ends, idx = jnp.asarray([2, 5, 9], jnp.int32), jnp.arange(10, dtype=jnp.int32)
    found = primitives(jax.make_jaxpr(lambda e, i: jnp.searchsorted(e, i, side="right"))(ends, idx))
    assert found & LOOPS


def test_group_metadata_has_no_loop_and_matches_searchsorted():
    sizes = jnp.asarray([3, 0, 6, 1, 0, 9], jnp.int32)
    assert not primitives(jax.make_jaxpr(group_metadata, static_argnums=(1, 2))(sizes, 19, 4)) & LOOPS
    group, tile, _, _ = group_metadata(sizes, 19, 4)
    ends = np.cumsum(np.asarray(sizes))
    first, last = (ends - np.asarray(sizes)) // 4, (ends - 1) // 4
    cum = np.cumsum(np.where(np.asarray(sizes) > 0, last - first + 1, 0))
    items = np.arange(len(group))
    want = np.where(items < cum[-1], np.minimum(np.searchsorted(cum, items, side="right"), 5), -1)
    np.testing.assert_array_equal(np.asarray(group), want)


def test_sequence_lengths_has_no_loop_and_matches_searchsorted():
    cu_q = jnp.asarray([0, 3, 4, 9, 9], jnp.int32)  # 4 sequences (one empty), rows 9-11 padding
    kv = jnp.asarray([10, 4, 7, 2], jnp.int32)
    lengths = lambda c, k: sequence_lengths(SimpleNamespace(cu_q_lens=c, kv_lens=k), 12)  # noqa: E731
    assert not primitives(jax.make_jaxpr(lengths)(cu_q, kv)) & LOOPS
    seq_of = np.minimum(np.searchsorted(np.asarray(cu_q[1:]), np.arange(12), side="right"), 3)
    np.testing.assert_array_equal(np.asarray(lengths(cu_q, kv)), np.asarray(kv)[seq_of])
