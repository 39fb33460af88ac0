"""The capture rows R a research step is compiled for: 32 while it captures at most 32 rows, else every
row of its token bucket (so two variants per bucket, both compiled ahead); only the captured rows, rounded
up to a power of two, are read back. Captured logits keep the power-of-two R (f32[R, V] of every row of a
prompt chunk would not fit)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.runner.research_batch import (
    ResearchBatch,
    _research_inputs,
    _Wanted,
    research_dims,
    smallest_research_inputs,
)

H = 16


@pytest.mark.parametrize(
    "captured,tokens,logits,want_r,want_read",
    [
        (0, 8, False, 32, 32),  # a step that only edits: the floor
        (5, 8, False, 32, 32),
        (32, 512, False, 32, 32),
        (33, 512, False, 512, 64),  # more than the floor: every row of the bucket, 64 of them read
        (300, 512, False, 512, 512),
        (40, 128, True, 64, 64),  # captured logits: the power of two
    ],
)
def test_rows_bucket_and_rows_read(captured, tokens, logits, want_r, want_read):
    rows = list(range(captured))
    ri = _research_inputs(rows, [3], [], [], [], [], tokens, H, logits)
    assert research_dims(ri)[0] == want_r
    np.testing.assert_array_equal(ri.cap_rows[:captured], rows)
    batch = ResearchBatch(ri, logits, {"r": _Wanted(positions=rows, rows=rows)})
    assert batch.rows_to_read == want_read


def test_the_variants_compiled_ahead_are_the_ones_steps_use():
    for tokens in (8, 32, 64, 8192):
        floor = research_dims(smallest_research_inputs(tokens, H))
        every = research_dims(smallest_research_inputs(tokens, H, all_rows=True))
        assert floor == research_dims(_research_inputs([1], [3], [], [], [], [], tokens, H))
        many = list(range(min(tokens, 33)))
        assert every == research_dims(_research_inputs(many, [3], [], [], [], [], tokens, H))
        assert every[0] == max(tokens, 32) and floor[0] == 32


def test_captured_rows_are_sliced_when_the_step_is_dispatched():
    """ModelRunner.dispatch keeps only the rows to read of a research step's buffers (an op enqueued at
    collect would queue behind the next step): [C + 1, R, H] -> [C + 1, n, H], logits [R, V] -> [n, V]."""
    import jax.numpy as jnp

    from jaxllm.runner.model_runner import _captured_rows

    rows = list(range(40))
    ri = _research_inputs(rows, [3], [], [], [], [], 512, H)  # R = 512, 64 rows read
    batch = ResearchBatch(ri, False, {"r": _Wanted(positions=rows, rows=rows)})
    caps = jnp.arange(9 * 512 * H, dtype=jnp.float32).reshape(9, 512, H)
    got, logits = _captured_rows(batch, (caps, None))
    assert got.shape == (9, 64, H) and logits is None
    np.testing.assert_array_equal(np.asarray(got), np.asarray(caps[:, :64]))
    got, logits = _captured_rows(batch, (caps, jnp.ones((512, 7))))
    assert logits.shape == (64, 7)
    small = ResearchBatch(_research_inputs(rows[:5], [3], [], [], [], [], 512, H), False, {})
    assert _captured_rows(small, (caps[:, :32], None))[0].shape == (9, 32, H)  # R = 32: kept whole


def test_packed_inputs_unpack_to_the_same_arrays():
    """The two arrays a research step is called with (PackedResearch) give back every field of its
    ResearchInputs, with shapes and values, also under jit (static slices from the pytree's dims)."""
    import jax

    from jaxllm.runner.research_batch import pack_research

    rng = np.random.default_rng(0)
    steers = [
        (2, rng.standard_normal(H).astype(np.float32), 0.5, 1, 4),
        (7, rng.standard_normal(H), 2.0, 4, 6),
    ]
    scales = [(3, 0.25, 0, 2)]
    heads = [(1, 2, 0.0, 2, 5), (0, 1, 3.0, 0, 8), (1, 0, 0.5, 3, 4)]
    patches = [(5, 3, rng.standard_normal(H).astype(np.float32))]
    for residual_only in (False, True):
        ri = _research_inputs(
            [1, 3, 4], [3, 9], steers, scales, heads, patches, 8, H, residual_only=residual_only
        )
        packed = pack_research(ri)
        assert packed.ints.dtype == np.int32 and packed.floats.dtype == np.float32
        assert research_dims(packed) == research_dims(ri)
        assert research_dims(ri)[-1] == residual_only
        for got in (packed.unpack(), jax.jit(lambda p: p.unpack())(packed)):
            assert got.residual_only is residual_only
            check_same_arrays(ri, got)


def check_same_arrays(ri, got):
    for name in ri.__dataclass_fields__:
        if name != "residual_only":
            want, have = getattr(ri, name), np.asarray(getattr(got, name))
            assert have.shape == want.shape, name
            np.testing.assert_array_equal(have, np.asarray(want, have.dtype), err_msg=name)


@pytest.mark.parametrize(
    "research, residual_only",
    [
        (dict(capture=["residual.0", "residual.1"]), True),
        (dict(steer=[("residual.1", 2.0)]), True),
        (dict(capture=["residual.0", "logits"], scale=[("residual.0", 0.5, None)]), True),
        (dict(capture=["residual.0", "attn_out.1"]), False),
        (dict(capture=["final_norm"]), False),
        (dict(steer=[("mlp_out.0", 1.0)]), False),
        (dict(scale=[("attn_out.1", 0.5, 1)]), False),  # a head scale acts inside attention
    ],
)
def test_steps_at_residual_sites_alone_run_the_residual_variant(research, residual_only):
    """A step whose captures, steers, scales and patches all sit on residual sites runs the variant that
    edits and captures only there (research_hooks.py); any other site, or a head scale, needs them all."""
    from types import SimpleNamespace

    from jaxllm.research_params import ResearchParams, Scale, Steer
    from jaxllm.runner.research_batch import build_research_batch

    vec = np.ones(H, np.float32)
    params = ResearchParams(
        capture=research.get("capture", []),
        steer=[Steer(site, vec, scale) for site, scale in research.get("steer", [])],
        scale=[Scale(site, f, head=h) for site, f, h in research.get("scale", [])],
    )
    plain = SimpleNamespace(params=SimpleNamespace(research=None), prompt_token_ids=[1, 2, 3])
    asking = SimpleNamespace(params=SimpleNamespace(research=params), prompt_token_ids=[1, 2, 3, 4])
    scheduled = [
        SimpleNamespace(req_id="a", start=0, num_new_tokens=3),
        SimpleNamespace(req_id="b", start=0, num_new_tokens=4),
    ]
    batch = build_research_batch(
        scheduled, [plain, asking], np.array([0, 3, 7]), 8, num_layers=2, hidden_size=H
    )
    assert batch.inputs.residual_only is residual_only
    assert research_dims(batch.inputs)[-1] == residual_only
