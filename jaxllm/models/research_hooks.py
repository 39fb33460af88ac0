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
    """What happens to one site's activation in this step (see the module docstring): the step's
    ResearchInputs read at the site's code. `apply_edit` turns it into one elementwise
    expression over [T, H], unrolled over the slots, so that XLA fuses the whole edit into a single
    kernel: a site costs one fusion, not a product, a dot and a scatter of its own (a step has 3L + 1
    sites, and at decode sizes their kernel launches, not their bytes, are what research costs)."""

    inputs: ResearchInputs
    code: jax.Array  # i32[] the site's code: an array, so that every layer shares one trace (layer_trace)


def site_edit(ri: ResearchInputs, code: int) -> SiteEdit:
    return SiteEdit(ri, jnp.asarray(code, jnp.int32))


def _row_scale(ri: ResearchInputs, code: int) -> jax.Array:  # f32[T]: the product of the code's factors
    scale = None
    for m in range(ri.scale_codes.shape[0]):
        f = jnp.where(ri.scale_codes[m] == code, ri.scale_factors[m], 1.0)
        scale = f if scale is None else scale * f
    return scale


def apply_edit(act: jax.Array, edit: SiteEdit | None) -> jax.Array:  # [T, H] -> [T, H]
    if edit is None:
        return act
    ri, code = edit.inputs, edit.code
    t = act.shape[0]
    out = act.astype(jnp.float32)
    scale = _row_scale(ri, code)
    if scale is not None:
        out = out * scale[:, None]
    for j in range(ri.steer_codes.shape[0]):  # + each steering vector of this code, times its row scales
        w = jnp.where(ri.steer_codes[j] == code, ri.steer_scales[j], 0.0)  # f32[T]
        out = out + w[:, None] * ri.steer_vectors[j][None, :]
    rows = jnp.arange(t, dtype=jnp.int32)
    for p in range(ri.patch_codes.shape[0]):  # patched rows replaced (the last of a row's patches wins)
        hit = (ri.patch_codes[p] == code) & (rows == ri.patch_rows[p])  # bool[T]
        out = jnp.where(hit[:, None], ri.patch_values[p][None, :], out)
    return out.astype(act.dtype)


def head_factors(ri: ResearchInputs, layer: int, num_heads: int) -> jax.Array:  # f32[T, Nq]
    """Per row and query head, the product of the head-scale slots of `layer` (1 where none asks),
    unrolled over the slots (elementwise: it fuses into the attention output's scaling)."""
    heads = jnp.arange(num_heads, dtype=jnp.int32)[None, :]
    out = jnp.ones((ri.head_factors.shape[1], num_heads), jnp.float32)
    for k in range(ri.head_layers.shape[0]):
        hit = (ri.head_layers[k] == layer) & (heads == ri.head_index[k])  # bool[1, Nq]
        out = out * jnp.where(hit, ri.head_factors[k][:, None], 1.0)
    return out


def empty_captures(ri: ResearchInputs, hidden: int, dtype) -> jax.Array:  # [C + 1, R, H]
    return jnp.zeros((ri.cap_codes.shape[0] + 1, ri.cap_rows.shape[0], hidden), dtype)


def capture(buf: jax.Array, ri: ResearchInputs, code: int, act: jax.Array) -> jax.Array:
    """Writes act[cap_rows] ([R, H]) into the slot asking for `code` (slot C when none does)."""
    c = ri.cap_codes.shape[0]
    if c == 0:
        return buf
    # the slot, as a sum of scalar selects rather than an argmax: slot codes are unique (each code seen
    # once, research_batch.py), and a scalar expression fuses into the update's kernel where a
    # reduction would be a kernel of its own at every site
    slot = jnp.int32(c)
    for k in reversed(range(c)):  # the first slot with this code wins, as argmax's first match did
        slot = jnp.where(ri.cap_codes[k] == code, jnp.int32(k), slot)
    rows = act[ri.cap_rows].astype(buf.dtype)  # [R, H]
    return jax.lax.dynamic_update_index_in_dim(buf, rows, slot, 0)
