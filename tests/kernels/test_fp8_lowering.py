"""FP8 pages through the Pallas -> Triton lowering for CUDA, on the CPU: an abstract H100 stands in for the
device (jax.sharding.use_abstract_mesh), so the kernels lower as they would for sm_90, up to the Triton IR
handed to XLA (Triton's own compile to PTX needs the GPU). An abstract A100 shows why the engine refuses
e4m3 pages below compute capability 8.9 (layers/attention.check_kv_cache_dtype). And the Hopper dispatcher
sends fp8 pages to the Triton kernel only: no Mosaic GPU kernel in what it lowers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from jaxllm.kernels.hopper_dispatch import ragged_paged_attention_hopper
from jaxllm.kernels.kv_write_pallas import write_kv_cache_pallas
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.triton_attention import ragged_paged_attention

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
SDS, I32 = jax.ShapeDtypeStruct, jnp.int32


def _lower(fn, *args, device_kind: str) -> str:
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _md(s: int, b: int) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(
        kv_lens=SDS((s,), I32),
        block_tables=SDS((s, b), I32),
        cu_q_lens=SDS((s + 1,), I32),
        num_seqs=SDS((1,), I32),
    )


def _attention(op, t: int, s: int, kv_dtype):
    """(fn, args) of op on Llama-3.1-8B heads with scales as a traced array and a float."""
    q = SDS((t, 32, 128), jnp.bfloat16)
    kv = SDS((8, 1000, 16, 128), kv_dtype)

    def fn(q, k, v, md, k_scale):
        return op(q, k, v, md, sm_scale=128**-0.5, k_scale=k_scale, v_scale=0.25)

    return fn, (q, kv, kv, _md(s, 64), SDS((), jnp.float32))


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("t, s", [(64, 64), (512, 16)], ids=["decode", "prefill"])
def test_attention_on_fp8_pages_lowers_for_h100(kv_dtype, t, s):
    fn, args = _attention(ragged_paged_attention, t, s, kv_dtype)
    text = _lower(fn, *args, device_kind=H100)
    assert "xla.gpu.triton" in text and "_fp8" in text  # the fp8 variant of the kernel


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_write_lowers_for_h100(kv_dtype):
    kv = SDS((8, 1000, 16, 128), kv_dtype)

    def fn(qkv, kp, vp, slots):  # k and v read in place from a fused q|k|v array
        return write_kv_cache_pallas(qkv, qkv, kp, vp, slots, 0.5, jnp.float32(0.25), k_head=32, v_head=40)

    text = _lower(fn, SDS((64, 48, 128), jnp.bfloat16), kv, kv, SDS((64,), I32), device_kind=H100)
    assert "write_kv_cache_fp8" in text


def test_e4m3_does_not_lower_for_a100_but_e5m2_does():
    fn, args = _attention(ragged_paged_attention, 64, 64, jnp.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        _lower(fn, *args, device_kind=A100)
    fn, args = _attention(ragged_paged_attention, 64, 64, jnp.float8_e5m2)
    assert "xla.gpu.triton" in _lower(fn, *args, device_kind=A100)


@pytest.mark.parametrize("t, s", [(512, 512), (2048, 16)], ids=["decode-512", "prefill-long-table"])
def test_hopper_dispatch_lowers_fp8_pages_to_triton_only(t, s):
    """At shapes where bf16 pages take the Mosaic GPU kernels (a 512-row decode batch: 4096 units; 2048
    prefill rows over 8192-token tables), fp8 pages lower to Triton launches alone."""
    b = 512 if t > s else 64

    def lowered(kv_dtype):
        q, kv = SDS((t, 32, 128), jnp.bfloat16), SDS((8, 9000, 16, 128), kv_dtype)

        def fn(q, k, v, md):
            return ragged_paged_attention_hopper(q, k, v, md, sm_scale=128**-0.5, k_scale=0.5, v_scale=0.25)

        return _lower(fn, q, kv, kv, _md(s, b), device_kind=H100)

    assert "mosaic_gpu" in lowered(jnp.bfloat16)
    fp8 = lowered(jnp.float8_e4m3fn)
    assert "mosaic_gpu" not in fp8 and "xla.gpu.triton" in fp8
