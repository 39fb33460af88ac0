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
bucket (R, C and the slot counts), never a new trace for new layers or sites. The per-code quantities are
resolved for every code once per step, before the layers (`resolve` -> StepResearch), so that inside the
layers each edit and capture is elementwise work that fuses with its neighbours.

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
class StepResearch:
    """ResearchInputs resolved for every site code at once, before the layers (`resolve`): what each
    layer's sites read is then a static row of these, and every edit and capture is elementwise work
    that fuses into the kernels around it. On the GPU each op of a step is a kernel launched from the
    host; resolving per site inside the layers (a product over the scale slots, a steering dot, a
    patch scatter, a slot search) added about twenty launches per layer, and with them host time that
    the device waited for."""

    scale: jax.Array  # f32[NC, T] per code and row: the product of its scale slots' factors
    steer: jax.Array  # f32[NC, J, T] per code: each steering slot's scale per row (0 off the code)
    patch_rows: jax.Array  # i32[NC, P] per code: the row each patch replaces (-1: not this code's)
    slot: jax.Array  # i32[NC] per code: its capture slot (C when none captures it)
    heads: jax.Array  # f32[L, T, Nq] per layer, row and query head: the head-scale factors
    inputs: ResearchInputs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SiteEdit:
    """What happens to one site's activation in this step (see the module docstring)."""

    scale: jax.Array  # f32[T]
    steer: jax.Array  # f32[J, T]
    steer_vectors: jax.Array  # f32[J, H]
    patch_rows: jax.Array  # i32[P] (-1: none)
    patch_values: jax.Array  # f32[P, H]


def resolve(ri: ResearchInputs, num_layers: int, num_heads: int) -> StepResearch:
    nc = len(LAYER_SITES) * num_layers + 1
    codes = jnp.arange(nc, dtype=jnp.int32)
    scale = jnp.prod(
        jnp.where((ri.scale_codes[None, :] == codes[:, None])[:, :, None], ri.scale_factors[None], 1.0),
        axis=1,
    )
    steer = jnp.where((ri.steer_codes[None, :] == codes[:, None])[:, :, None], ri.steer_scales[None], 0.0)
    patch_rows = jnp.where(ri.patch_codes[None, :] == codes[:, None], ri.patch_rows[None, :], -1)
    c = ri.cap_codes.shape[0]
    match = jnp.concatenate([ri.cap_codes[None, :] == codes[:, None], jnp.ones((nc, 1), bool)], axis=1)
    slot = jnp.argmax(match, axis=1).astype(jnp.int32) if c else jnp.zeros((nc,), jnp.int32)
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    hit = (ri.head_layers[None, :, None] == layers[:, None, None]) & (
        jnp.arange(num_heads)[None, None, :] == ri.head_index[None, :, None]
    )  # [L, K, Nq]
    per_slot = jnp.where(hit[:, :, None, :], ri.head_factors[None, :, :, None], 1.0)  # [L, K, T, Nq]
    return StepResearch(scale, steer, patch_rows, slot, jnp.prod(per_slot, axis=1), ri)


def site_edit(sr: StepResearch, code: int) -> SiteEdit:
    ri = sr.inputs
    return SiteEdit(sr.scale[code], sr.steer[code], ri.steer_vectors, sr.patch_rows[code], ri.patch_values)


def apply_edit(act: jax.Array, edit: SiteEdit | None) -> jax.Array:  # [T, H] -> [T, H]
    """act * scale + the steering slots' vectors times their scales, then the patched rows replaced.
    The slots (J steers, P patches: at least 8 each, rarely more) are unrolled into elementwise terms,
    so the whole edit is one fusion (no dot, no scatter)."""
    if edit is None:
        return act
    out = act.astype(jnp.float32) * edit.scale[:, None]
    for j in range(edit.steer.shape[0]):
        out = out + edit.steer[j][:, None] * edit.steer_vectors[j][None, :]
    rows = jnp.arange(act.shape[0], dtype=jnp.int32)[:, None]
    for p in range(edit.patch_rows.shape[0]):  # a later patch of the same row wins
        out = jnp.where(rows == edit.patch_rows[p], edit.patch_values[p][None, :], out)
    return out.astype(act.dtype)


def head_factors(sr: StepResearch, layer: int) -> jax.Array:  # f32[T, Nq]
    """Per row and query head, the product of the head-scale slots of `layer` (1 where none asks)."""
    return sr.heads[layer]


def empty_captures(ri: ResearchInputs, hidden: int, dtype) -> jax.Array:  # [C + 1, R, H]
    return jnp.zeros((ri.cap_codes.shape[0] + 1, ri.cap_rows.shape[0], hidden), dtype)


def capture(buf: jax.Array, sr: StepResearch, code: int, act: jax.Array) -> jax.Array:
    """Writes act[cap_rows] ([R, H]) into the slot asking for `code` (slot C when none does)."""
    ri = sr.inputs
    if ri.cap_codes.shape[0] == 0:
        return buf
    rows = act[ri.cap_rows].astype(buf.dtype)  # [R, H]
    return jax.lax.dynamic_update_index_in_dim(buf, rows, sr.slot[code], 0)
