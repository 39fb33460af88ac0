"""Pallas ops for paged attention and quantized GEMMs on NVIDIA GPUs, each with a plain-jnp reference.
Imports only jax and numpy.

Every attention op has the reference's contract (reference.py) and signature:
`(q, k_pages, v_pages, md, *, sm_scale, ...)`, md a PagedAttentionMetadata (metadata.py). The attention
layer writes the step's K/V into the paged cache first (ops.write_kv_cache), then attends. Pages are q's
dtype or fp8 (kv_quant.py); the writes, the reference and the ops of ops.py take fp8 pages' scales as
k_scale, v_scale (the Mosaic kernels read 16-bit pages only, and the dispatcher keeps fp8 off them).

  ops.py              the public GPU ops the attention layer calls
  reference.py        the plain-jnp reference (the CPU backend; what every kernel is tested against)
  metadata.py         the batch description (one pytree) and the input checks every op shares
  ragged_batch.py     decode-like batches, row owners, the grouped query layout launches share
  triton_attention.py the Triton-lowered kernel: any CUDA GPU, any batch
  triton_schedule.py  its work items (query rows of one sequence per program)
  hopper_dispatch.py  on sm_90, routes each row to the fastest kernel (Mosaic or Triton), one output
  mosaic_decode.py    persistent Mosaic GPU kernel for decode rows (one row per unit)
  mosaic_prefill.py   persistent Mosaic GPU kernel for long prefill chunks (128-row tiles)
  mosaic_schedule.py  the prefill kernel's tiles, work items and config
  mosaic_common.py    what both Mosaic kernels share: KV ring, online softmax, unit schedule, launch
  kv_write_pallas.py  the KV-cache write kernel; kv_write_xla.py its XLA-scatter twin and reference
  w4a16_matmul.py     the int4-weight GEMM (W4A16, decode-oriented), Triton-lowered
  w4a16_gemv.py       the same product for up to 8 rows on the CUDA cores (no tensor-core tiles)
  int4_reference.py   the int4 weight layout: packing, dequantization, the plain-jnp reference matmul
  kv_quant.py         FP8 pages: how K/V are stored in 8 bits with per-layer scales and read back

Shapes (dimension letters):
  T  tokens in the flattened (ragged) batch      S  sequences (padded bucket)
  Hq query heads   Hkv key/value heads   D head dim   P pages in the pool   PS page size (tokens)
  B  pages per sequence in the block table       G  query heads per KV head (Gp: padded)
  GEMMs: M rows (tokens)  K inputs  N outputs  g quantization group size (inputs per scale)
"""

from jaxllm.kernels.metadata import PagedAttentionMetadata

__all__ = ["PagedAttentionMetadata"]
