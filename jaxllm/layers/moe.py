"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): router top-k, then SwiGLU experts grouped by expert.

Data flow of `sparse_moe(x, router, gate_up, down, ...)` (T tokens, H hidden, E experts, K experts per token,
I each expert's intermediate width, M = T * K routed rows):

  x [T, H] -> router logits f32[T, E] -> softmax -> top-k: weights f32[T, K], expert ids i32[T, K]
           (renormalised to sum to 1 when `renormalize`: Mixtral always, Qwen3-MoE per norm_topk_prob)
  -> the M (token, expert) rows sorted by expert (stable), group_sizes i32[E] = rows per expert
  -> grouped GEMM  x rows [M, H] . gate_up [E, H, 2I] -> [M, 2I] -> act(gate) * up [M, I]
  -> grouped GEMM  [M, I] . down [E, I, H] -> [M, H]
  -> rows back in token order, weighted by the routing weights and summed over K -> [T, H]

Every expert's weights are read once per call whatever the routing, and each row is multiplied by its
own expert only: unlike a dense einsum over all experts, the FLOPs are those of K experts per token.
`grouped_matmul` is the one place the grouped GEMM happens: with `kernel` (the model's GPU kernels) the
Pallas grouped GEMM (kernels/grouped_matmul.py), which reads only the experts a tile of rows routes to;
else `jax.lax.ragged_dot`, whose default GPU lowering multiplies every row by every expert (an f32[M, E, N]
temporary: 24 GiB at Qwen3-30B-A3B's prefill) and is kept for the CPU and the plain-jnp reference.

Tensor parallelism splits every expert (vLLM's default for its fused MoE, as opposed to expert
parallelism): each device holds the I / N columns of gate and up and the I / N rows of down of all E
experts (gate|up fused shard by shard, models/fused_projections.py), routes every token itself (the
router is small and replicated) and adds its partial [T, H] to the others' with one all-reduce, the
dense MLP's communication. The load is even whatever the routing; N must divide I.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul
from jaxllm.kernels.grouped_matmul import serves as kernel_serves
from jaxllm.layers.tensor_parallel import TP_AXIS, current_tp_mesh


def route_top_k(
    router_logits: jax.Array,  # f32[T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[jax.Array, jax.Array]:  # (weights f32[T, K], expert ids i32[T, K])
    """Softmax over all experts, then the k largest probabilities (HF's and vLLM's order: softmax first,
    so un-renormalised weights are the experts' shares of the whole distribution)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_matmul(
    rows: jax.Array,  # [M, K_in]: rows sorted by group, group g's rows next to each other
    weights: jax.Array,  # [E, K_in, N]
    group_sizes: jax.Array,  # i32[E]: rows of each group, in order; sums to <= M
    kernel: bool = False,
) -> jax.Array:  # f32[M, N]; rows past sum(group_sizes) are zero
    """rows[j] . weights[group of j]: the experts' GEMMs in one call, accumulated in float32. `kernel`: the
    Pallas grouped GEMM (interpreted off the GPU, as the kernel tests run it)."""
    if kernel and kernel_serves(rows, weights):
        return pallas_grouped_matmul(rows, weights, group_sizes, interpret=jax.default_backend() != "gpu")
    return jax.lax.ragged_dot(rows, weights, group_sizes, preferred_element_type=jnp.float32)


def moe_experts(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    expert_ids: jax.Array,  # i32[T, K]
    gate_up: jax.Array,  # [E, H, 2I]: gate|up, laid out for `shards` (models/fused_projections.py)
    down: jax.Array,  # [E, I, H]
    act: Callable[[jax.Array], jax.Array],
    shards: int = 1,
    kernel: bool = False,  # the Pallas grouped GEMM (grouped_matmul)
) -> jax.Array:  # f32[T, H]
    """Every token through its K experts, weighted and summed (module docstring)."""
    t, k = expert_ids.shape
    e = gate_up.shape[0]
    flat_ids = expert_ids.reshape(-1)  # i32[M], row j is token j // K
    order = jnp.argsort(flat_ids, stable=True)  # i32[M]: rows by expert
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)  # i32[E]
    h = grouped_matmul(x[order // k], gate_up, group_sizes, kernel)  # f32[M, 2I]
    width = h.shape[-1] // (2 * shards)
    h = h.reshape(-1, shards, 2, width)  # each shard's [gate | up]
    inner = (act(h[:, :, 0]) * h[:, :, 1]).reshape(-1, shards * width).astype(x.dtype)  # [M, I]
    y = grouped_matmul(inner, down, group_sizes, kernel)  # f32[M, H]
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))  # i32[M]
    y = y[unsort].reshape(t, k, -1)  # f32[T, K, H] in token order
    return jnp.einsum("tkh,tk->th", y, weights.astype(jnp.float32))


def sparse_moe(
    x: jax.Array,  # [T, H]
    router: jax.Array,  # [H, E]
    gate_up: jax.Array,  # [E, H, 2I]
    down: jax.Array,  # [E, I, H]
    *,
    top_k: int,
    renormalize: bool,
    act: Callable[[jax.Array], jax.Array],
    shards: int = 1,  # the tensor-parallel shards gate|up is laid out for
    kernel: bool = False,  # the Pallas grouped GEMM (grouped_matmul)
) -> jax.Array:  # [T, H] in x's dtype
    """The MoE MLP of one layer; under a tensor-parallel mesh each device runs its slice of every expert
    (module docstring) inside `shard_map`."""

    def local(x, router, gate_up, down, shards):
        logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)  # f32[T, E]
        weights, ids = route_top_k(logits, top_k, renormalize)
        return moe_experts(x, weights, ids, gate_up, down, act, shards, kernel)

    mesh = current_tp_mesh()
    if mesh is None:
        return local(x, router, gate_up, down, shards).astype(x.dtype)
    n = mesh.shape[TP_AXIS]
    if gate_up.shape[-1] % (2 * n):
        raise ValueError(
            f"the experts' intermediate size {gate_up.shape[-1] // 2} does not split over {n} devices"
        )
    out = jax.shard_map(
        lambda x, r, gu, d: jax.lax.psum(local(x, r, gu, d, 1), TP_AXIS),
        mesh=mesh,
        # tokens and router whole on every device; gate|up split along its outputs, down along its inputs
        in_specs=(P(), P(), P(None, None, TP_AXIS), P(None, TP_AXIS, None)),
        out_specs=P(),
        check_vma=False,
    )(x, router, gate_up, down)
    return out.astype(x.dtype)
