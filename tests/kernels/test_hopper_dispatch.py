"""ragged_paged_attention_hopper (Mosaic decode and prefill kernels, the Triton kernel for the rest)
against ref_ragged_paged_attention, and the row routing between its kernels.

On the CPU both kernels run in interpret mode; `--gpu` runs the same cases compiled on the GPU
(`pytest -m "gpu or not gpu" --gpu tests/kernels/test_hopper_dispatch.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.hopper_dispatch import (
    decode_mosaic_covers,
    mosaic_covers,
    ragged_paged_attention_hopper,
)
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.mosaic_prefill import prefill_paged_attention_mgpu
from jaxllm.kernels.mosaic_schedule import MgpuConfig, max_padded_items, work_items
from jaxllm.kernels.reference import ref_ragged_paged_attention
from jaxllm.testing.kernel_cases import assert_matches_reference, make_problem, rel_err, tolerance
from tests.kernels.checks import check_against_reference

# (q_lens, kv_lens, dtype, page_size, (hq, hkv), d, mosaic_min_q_len, extra kwargs). Every batch mixes
# decode rows, chunks shorter than mosaic_min_q_len and longer ones (two tiles and a ragged tail);
# lengths 3, 20, 150, 513, 1023 do not line up with pages or tiles.
P0 = {"prefill_min_context": 0}  # the Mosaic prefill kernel at these short block tables too
CASES = [
    ([1, 150, 1, 20, 3], [1023, 300, 513, 20, 40], jnp.bfloat16, 16, (4, 2), 64, 128, P0),
    ([1, 150, 1, 20, 3], [1023, 300, 513, 20, 40], jnp.bfloat16, 16, (4, 2), 64, 16, P0),
    ([20, 1, 131], [700, 64, 131], jnp.float16, 32, (4, 1), 128, 128, P0),
    ([40, 1, 70], [40, 9, 500], jnp.bfloat16, 64, (2, 1), 256, 32, P0),
    # Not covered by the Mosaic kernel: the whole batch on the Triton kernel.
    ([1, 150, 1, 20, 3], [1023, 300, 513, 20, 40], jnp.bfloat16, 16, (4, 2), 64, 16, {}),  # short tables
    ([1, 150, 1, 20], [1023, 300, 513, 20], jnp.bfloat16, 16, (4, 2), 64, 128, {"soft_cap": 20.0, **P0}),
    ([1, 150, 3], [64, 200, 40], jnp.bfloat16, 16, (4, 2), 64, 128, {"sliding_window": 50, **P0}),
    ([1, 1, 1, 2], [100, 3, 513, 9], jnp.bfloat16, 16, (4, 2), 64, 2, P0),  # decode-like batch
    ([1], [700], jnp.bfloat16, 16, (4, 2), 64, 128, P0),  # one decoding sequence (a one-token bucket)
    # Decode-like batches on the Mosaic decode kernel (their chunks and padding rows on the Triton one).
    ([1, 1, 1, 2], [100, 3, 513, 9], jnp.bfloat16, 16, (4, 2), 64, 128, {"decode_min_units": 1}),
    ([1, 3, 1, 1], [1023, 40, 17, 64], jnp.float16, 8, (8, 1), 128, 128, {"decode_min_units": 1}),
]


def _id(c):
    q_lens, kv_lens, dt, ps, (hq, hkv), d, m, kw = c
    extra = "".join(f"-{k}{v}" for k, v in kw.items())
    return f"q{'-'.join(map(str, q_lens))}-{jnp.dtype(dt).name}-ps{ps}-h{hq}x{hkv}-d{d}-min{m}{extra}"


@pytest.mark.own_process
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case, interpret):
    q_lens, kv_lens, dtype, ps, (hq, hkv), d, min_q_len, kw = case
    prob = make_problem(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=dtype)
    check_against_reference(
        ragged_paged_attention_hopper, prob, sm_scale=d**-0.5, mosaic_min_q_len=min_q_len, interpret=interpret,
        **kw,
    )  # fmt: skip


@pytest.mark.gpu
def test_llama_shapes_on_gpu(on_gpu):
    """Llama-3.1-8B heads (32 q / 8 kv, d 128), page 16, bf16: decodes, a short chunk and two long ones
    (one of them a continuation over earlier context), as an engine step mixes them."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    q_lens, kv_lens = [1, 1, 512, 1, 300, 40], [700, 2000, 512, 65, 1000, 40]
    prob = make_problem(q_lens, kv_lens, hq=32, hkv=8, d=128, page_size=16, dtype=jnp.bfloat16)
    check_against_reference(ragged_paged_attention_hopper, prob, sm_scale=128**-0.5, prefill_min_context=0)


@pytest.mark.gpu
def test_llama_decode_batch_on_gpu(on_gpu):
    """A decode-like Llama-3.1-8B batch of 64 sequences (512 units: the Mosaic decode kernel) with one
    3-row chunk (the Triton kernel) and padding rows."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    kv_lens = [640, 1, 17, 2048, 1000, 33, 129, 511] * 8
    q_lens = [1] * 63 + [3]
    prob = make_problem(q_lens, kv_lens, hq=32, hkv=8, d=128, page_size=16, dtype=jnp.bfloat16, pad_rows=5)
    t, s = prob.q.shape[0], prob.md.kv_lens.shape[0]
    assert decode_mosaic_covers(
        t, s, 32, 8, jnp.bfloat16, 16, soft_cap=None, sliding_window=None, min_units=256
    )
    check_against_reference(ragged_paged_attention_hopper, prob, sm_scale=128**-0.5)


@pytest.mark.own_process
@pytest.mark.parametrize(
    "q_lens, kv_lens, pad_rows, pad_seqs",
    [
        ([1, 3, 1, 1], [1023, 40, 17, 64], 2, 4),  # a 3-row chunk and padding rows in a T == S bucket
        ([1, 1, 1], [130, 1, 700], 1, 1),  # decodes only, one padding row
    ],
)
def test_decode_bucket_takes_every_row(q_lens, kv_lens, pad_rows, pad_seqs, interpret, monkeypatch):
    """With as many rows as sequences (T == S) the Mosaic decode kernel answers every row, the chunk's
    rows each over its context up to its own position, and no Triton launch follows."""
    import jaxllm.kernels.hopper_dispatch as hopper

    prob = make_problem(
        q_lens, kv_lens, hq=8, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16,
        pad_rows=pad_rows, pad_seqs=pad_seqs,
    )  # fmt: skip
    assert prob.q.shape[0] == prob.md.kv_lens.shape[0]

    def no_triton(*args, **kwargs):
        raise AssertionError("a T == S decode batch launched the Triton kernel")

    monkeypatch.setattr(hopper, "launch_rows", no_triton)
    monkeypatch.setattr(hopper, "ragged_paged_attention", no_triton)
    check_against_reference(
        ragged_paged_attention_hopper, prob, sm_scale=0.125, decode_min_units=1, interpret=interpret
    )


@pytest.mark.own_process
def test_mosaic_takes_exactly_the_long_chunks(interpret):
    """With min_q_len the Mosaic kernel answers the long chunks and leaves every other row zero, so the
    Triton launches that follow own the rest; a wrong routing shows up here as well as in the result."""
    q_lens, kv_lens = [1, 150, 20, 1, 64], [300, 150, 220, 9, 64]
    prob = make_problem(q_lens, kv_lens, hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    out = np.asarray(
        prefill_paged_attention_mgpu(*prob.args(), sm_scale=0.125, min_q_len=64, interpret=interpret),
        np.float32,
    )
    ref = np.asarray(ref_ragged_paged_attention(*prob.args(), sm_scale=0.125), np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for i, n in enumerate(q_lens):
        rows = slice(cu[i], cu[i + 1])
        if n >= 64:
            assert rel_err(out[rows], ref[rows]) < tolerance(jnp.bfloat16), f"sequence {i}"
        else:
            assert (out[rows] == 0).all(), f"sequence {i} ({n} rows) belongs to the Triton kernel"
    assert (out[cu[-1] :] == 0).all()


@pytest.mark.parametrize("seed", range(5))
def test_padded_items_fit_their_bound(seed):
    """Random ragged batches: the items of the selected sequences never exceed max_padded_items, and every
    selected row is listed exactly once."""
    rng = np.random.default_rng(seed)
    t, s, m = 1024, 64, 128
    cfg = MgpuConfig()
    q_lens = []
    while sum(q_lens) < t - 300:
        q_lens.append(int(rng.choice([1, 2, 50, 127, 128, 129, 300])))
    q_lens = q_lens[:s]
    n = len(q_lens)
    cu = np.zeros(s + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv = np.zeros(s, np.int32)
    kv[:n] = np.asarray(q_lens) + 7
    md = PagedAttentionMetadata(
        kv_lens=jnp.asarray(kv), block_tables=jnp.zeros((s, 1), jnp.int32), cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([n], jnp.int32),
    )  # fmt: skip
    items = work_items(md, num_tokens=t, cfg=cfg, aligned=False, min_q_len=m)
    w = items.table.shape[1]
    assert w == max_padded_items(t, s, cfg.tile, m) == -(-t // cfg.tile) + t // m
    need = sum(-(-q // cfg.tile) for q in q_lens if q >= m)
    assert int((np.asarray(items.table)[2] > 0).sum()) == need <= w
    selected = np.zeros(t, bool)
    for i, q in enumerate(q_lens):
        selected[cu[i] : cu[i + 1]] = q >= m
    np.testing.assert_array_equal(np.asarray(items.row_valid), selected)


def test_coverage_rules():
    kw = dict(soft_cap=None, sliding_window=None, min_context=8192)
    assert mosaic_covers(2048, 256, 512, jnp.bfloat16, 16, 128, **kw)
    assert not mosaic_covers(2048, 256, 511, jnp.bfloat16, 16, 128, **kw)  # contexts stay under 8192
    assert mosaic_covers(2048, 256, 64, jnp.bfloat16, 16, 128, **{**kw, "min_context": 0})
    assert not mosaic_covers(256, 256, 512, jnp.bfloat16, 16, 128, **kw)  # decode-like
    assert not mosaic_covers(2048, 256, 512, jnp.float32, 16, 128, **kw)
    assert not mosaic_covers(2048, 256, 2048, jnp.bfloat16, 4, 128, **kw)  # page below 8
    assert not mosaic_covers(2048, 256, 64, jnp.bfloat16, 128, 256, **kw)  # does not divide 64-token blocks
    assert not mosaic_covers(2048, 256, 512, jnp.bfloat16, 16, 128, **{**kw, "soft_cap": 30.0})
    assert mosaic_covers(2048, 256, 512, jnp.bfloat16, 16, 128, **kw, kv_dtype=jnp.bfloat16)
    for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):  # fp8 pages stay on the Triton kernel
        assert not mosaic_covers(2048, 256, 512, jnp.bfloat16, 16, 128, **kw, kv_dtype=fp8)


def test_decode_coverage_rules():
    kw = dict(soft_cap=None, sliding_window=None, min_units=256)
    assert decode_mosaic_covers(32, 32, 32, 8, jnp.bfloat16, 16, **kw)  # 256 units
    assert not decode_mosaic_covers(16, 16, 32, 8, jnp.bfloat16, 16, **kw)  # 128 units: Triton's splits
    assert not decode_mosaic_covers(8, 8, 32, 8, jnp.bfloat16, 16, **kw)  # short contexts too
    assert not decode_mosaic_covers(2048, 256, 32, 8, jnp.bfloat16, 16, **kw)  # not decode-like
    assert not decode_mosaic_covers(256, 256, 32, 8, jnp.float32, 16, **kw)
    assert not decode_mosaic_covers(256, 256, 32, 8, jnp.bfloat16, 4, **kw)  # page below 8
    assert not decode_mosaic_covers(256, 256, 128, 1, jnp.bfloat16, 16, **kw)  # 128 heads per KV head
    assert not decode_mosaic_covers(256, 256, 32, 8, jnp.bfloat16, 16, **{**kw, "soft_cap": 30.0})
    assert decode_mosaic_covers(32, 32, 32, 8, jnp.bfloat16, 16, **kw, kv_dtype=jnp.bfloat16)
    for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        assert not decode_mosaic_covers(32, 32, 32, 8, jnp.bfloat16, 16, **kw, kv_dtype=fp8)


@pytest.mark.parametrize(
    "q_lens, kv_lens, kw",
    [
        ([1, 150, 1, 20, 3], [1023, 300, 513, 20, 40], {"mosaic_min_q_len": 16, **P0}),  # prefill routing
        ([1, 1, 1, 2], [100, 3, 513, 9], {"decode_min_units": 1}),  # decode routing
        ([1, 1, 1, 1], [100, 3, 513, 9], {"decode_min_units": 1}),  # a T == S decode bucket
    ],
    ids=["prefill", "decode-like", "decode-bucket"],
)
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pages_go_to_the_triton_kernel(q_lens, kv_lens, kw, kv_dtype, interpret, monkeypatch):
    """Batches that would take the Mosaic kernels run on the Triton kernel when the pages are fp8 (module
    docstring of hopper_dispatch.py), with the scales, and match the reference on those pages."""
    import jaxllm.kernels.hopper_dispatch as hopper

    def no_mosaic(*args, **kwargs):
        raise AssertionError("fp8 pages reached a Mosaic kernel")

    monkeypatch.setattr(hopper, "prefill_paged_attention_mgpu", no_mosaic)
    monkeypatch.setattr(hopper, "decode_launch", no_mosaic)
    prob = make_problem(
        q_lens, kv_lens, hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16, kv_dtype=kv_dtype
    )
    check_against_reference(ragged_paged_attention_hopper, prob, sm_scale=0.125, interpret=interpret, **kw)


def test_rejects_min_q_len_below_two():
    prob = make_problem([1, 40], [5, 40], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="mosaic_min_q_len"):
        ragged_paged_attention_hopper(*prob.args(), sm_scale=0.125, mosaic_min_q_len=1, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_lens, kv_lens",
    [
        ([1], [640]),
        ([1] * 64, [640, 17, 2048, 33] * 16),
        ([1, 1, 512, 1, 300, 40], [700, 2000, 512, 65, 1000, 40]),
    ],
    ids=["b1", "b64", "mixed"],
)
@pytest.mark.parametrize("kernel", ["triton", "hopper"])
def test_fused_qkv_input_on_gpu(on_gpu, q_lens, kv_lens, kernel):
    """q_heads: the queries read out of a fused [T, Hq + 2 Hkv, D] array (in place, through the grouped
    view, where the layout allows) give the reference's output, as q on its own does. Llama-3.1-8B heads."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    from jaxllm.kernels.triton_attention import ragged_paged_attention

    prob = make_problem(q_lens, kv_lens, hq=32, hkv=8, d=128, page_size=16, dtype=jnp.bfloat16)
    t = prob.q.shape[0]
    kv = jnp.asarray(np.random.default_rng(5).standard_normal((t, 16, 128)), jnp.bfloat16)
    qkv = jnp.concatenate([prob.q, kv], axis=1)  # k and v heads follow; the kernels must not read them
    fn = ragged_paged_attention_hopper if kernel == "hopper" else ragged_paged_attention
    args = prob.args()[1:]
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=128**-0.5)
    out = fn(qkv, *args, sm_scale=128**-0.5, q_heads=32)
    assert_matches_reference(out, ref, prob, tolerance(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(prob.q, *args, sm_scale=128**-0.5)))
