"""Captures and interventions compiled into the model step: the device half of jaxllm/research_params.py.

A step with research (`ResearchInputs`, arrays of static shape) runs a variant of the model step in which
each layer site's activation `a` (code c) becomes

    a' = a * scale_c + steer_c, then the patched rows replaced        (`SiteEdit`, built by `site_edit`)

  - scale_c f32[T]: the product of the factors of the scale slots whose code is c, per row (1 elsewhere);
  - steer_c [T, H]: the steering slots' scale[:, rows] masked to code c, times their vectors;
  - patches: rows of the step set to stored vectors (activation patching);
and a head's output inside attention (before o_proj) is scaled by `head_factors` ([T, Nq]); then the value
of each captured site (code in `cap_codes`) at the rows `cap_rows` is copied into its slot of a
[C + 1, R, H] buffer (slot C takes what no slot asked for and is dropped). Captures read a'.
Which sites, layers, heads and rows are data, not program: any mix of requests runs the variant of its
bucket (R, C and the slot counts), never a new trace for new layers or sites.

Site codes: "residual.i" -> i, "attn_out.i" -> L + i, "mlp_out.i" -> 2L + i, "final_norm" -> 3L;
-1 is an unused slot. Logits are captured by the step itself (a flag of the variant), not by code.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.research_params import LAYER_SITES, Site


def site_code(site: Site, num_layers: int) -> int:
    if site.kind == "final_norm":
        return len(LAYER_SITES) * num_layers
    return LAYER_SITES.index(site.kind) * num_layers + site.layer


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ResearchInputs:
    cap_rows: jax.Array  # i32[R] rows of the step to capture (padding: 0, its values are never read)
    cap_codes: jax.Array  # i32[C] the site code of each capture slot, -1 unused
    steer_codes: jax.Array  # i32[J] the site code of each steering vector, -1 unused
    steer_vectors: jax.Array  # f32[J, H]
    steer_scales: jax.Array  # f32[J, T] per row of the step (0: the row's request does not steer)
    scale_codes: jax.Array  # i32[M] the site code of each scale slot, -1 unused
    scale_factors: jax.Array  # f32[M, T] per row (1: the row's request does not scale)
    head_layers: jax.Array  # i32[K] the layer of each head-scale slot, -1 unused
    head_index: jax.Array  # i32[K] the query head it scales
    head_factors: jax.Array  # f32[K, T] per row (1: the row's request does not scale it)
    patch_codes: jax.Array  # i32[P] the site code of each patch, -1 unused
    patch_rows: jax.Array  # i32[P] the row it replaces (T: none, dropped)
    patch_values: jax.Array  # f32[P, H]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SiteEdit:
    """What happens to one site's activation in this step (see the module docstring)."""

    scale: jax.Array  # f32[T]
    add: jax.Array  # f32[T, H]
    patch_rows: jax.Array  # i32[P] (T: dropped)
    patch_values: jax.Array  # f32[P, H]


def site_edit(ri: ResearchInputs, code: int) -> SiteEdit:
    scale = jnp.prod(jnp.where((ri.scale_codes == code)[:, None], ri.scale_factors, 1.0), axis=0)
    w = jnp.where((ri.steer_codes == code)[:, None], ri.steer_scales, 0.0)  # f32[J, T]
    add = jnp.einsum("jt,jh->th", w, ri.steer_vectors)
    t = ri.steer_scales.shape[1]
    rows = jnp.where(ri.patch_codes == code, ri.patch_rows, t)
    return SiteEdit(scale, add, rows, ri.patch_values)


def apply_edit(act: jax.Array, edit: SiteEdit | None) -> jax.Array:  # [T, H] -> [T, H]
    if edit is None:
        return act
    out = act.astype(jnp.float32) * edit.scale[:, None] + edit.add
    out = out.at[edit.patch_rows].set(edit.patch_values, mode="drop")
    return out.astype(act.dtype)


def head_factors(ri: ResearchInputs, layer: int, num_heads: int) -> jax.Array:  # f32[T, Nq]
    """Per row and query head, the product of the head-scale slots of `layer` (1 where none asks)."""
    hit = (ri.head_layers == layer)[:, None] & (jnp.arange(num_heads)[None, :] == ri.head_index[:, None])
    per_slot = jnp.where(hit[:, None, :], ri.head_factors[:, :, None], 1.0)  # f32[K, T, Nq]
    return jnp.prod(per_slot, axis=0)


def empty_captures(ri: ResearchInputs, hidden: int, dtype) -> jax.Array:  # [C + 1, R, H]
    return jnp.zeros((ri.cap_codes.shape[0] + 1, ri.cap_rows.shape[0], hidden), dtype)


def capture(buf: jax.Array, ri: ResearchInputs, code: int, act: jax.Array) -> jax.Array:
    """Writes act[cap_rows] ([R, H]) into the slot asking for `code` (slot C when none does)."""
    c = ri.cap_codes.shape[0]
    if c == 0:
        return buf
    match = jnp.concatenate([ri.cap_codes == code, jnp.ones((1,), bool)])
    slot = jnp.argmax(match)  # the first slot with this code; C when none has it
    rows = act[ri.cap_rows].astype(buf.dtype)  # [R, H]
    return jax.lax.dynamic_update_index_in_dim(buf, rows, slot, 0)
