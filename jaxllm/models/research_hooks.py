"""Captures and interventions compiled into the model step: the device half of jaxllm/research_params.py.

A step with research (`ResearchInputs`, arrays of static shape) runs a variant of the model step in which
each layer site's activation `a` (code c) becomes

    a' = a * scale_c + steer_c, then the patched rows replaced        (`apply_edit`)

  - scale_c f32[T]: the product of the factors of the scale slots whose code is c, per row (1 elsewhere);
  - steer_c [T, H]: the steering slots' scale[:, rows] masked to code c, times their vectors;
  - patches: rows of the step set to stored vectors (activation patching);
and a head's output inside attention (before o_proj) is scaled by `head_factors` ([T, Nq]); then the value
of each captured site (code in `cap_codes`) at the rows `cap_rows` is copied into its slot of a
[C + 1, R, H] buffer (slot C takes what no slot asked for and is dropped). Captures read a'.
Which sites, layers, heads and rows are data, not program: any mix of requests runs the variant of its
bucket (R, C and the slot counts), never a new trace for new layers or sites. The slots are arranged by
site code once per step (`research_tables`); each site then reads its rows of those tables.

Site codes: "residual.i" -> i, "attn_out.i" -> L + i, "mlp_out.i" -> 2L + i, "final_norm" -> 3L;
-1 is an unused slot. Logits are captured by the step itself (a flag of the variant), not by code.

Two variants per slot sizes: every site (an edit and a capture at each of the 3L + 1), or, where a
step's slots all sit on residual sites (`ResearchInputs.residual_only`: the common case of residual
captures and steering vectors), the residual sites alone. At decode sizes each site's edit and capture
is a small kernel of its own, so the residual variant launches a third of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.research_params import LAYER_SITES, Site


def site_code(site: Site, num_layers: int) -> int:
    if site.kind == "final_norm":
        return len(LAYER_SITES) * num_layers
    return LAYER_SITES.index(site.kind) * num_layers + site.layer


def is_residual_code(code: int, num_layers: int) -> bool:
    """Whether `code` (site_code's) is a "residual.i" site: those come first, 0 .. L - 1."""
    return 0 <= code < num_layers


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
    # Static: every slot of the step sits on a residual site (`is_residual_code`; no head scale), so the
    # variant edits and captures only there (LlamaForCausalLM.__call__).
    residual_only: bool = field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ResearchTables:
    """A step's ResearchInputs arranged by site code (S = 3L + 1 codes), made once per step by
    `research_tables`, so that what a site does is a few rows read at its code: its edit is one
    elementwise expression over [T, H] that XLA fuses into a single kernel, and its capture fuses into
    the buffer's update. Made per site from the slots instead, each site was a product, a dot, a scatter
    and an argmax of its own: about 4 kernels at each of the 3L + 1 sites, each launched by the host, for
    arrays that at decode sizes take the device next to no time."""

    scale: jax.Array  # f32[S, T] the product of each code's scale factors per row (1: none)
    steer: jax.Array  # f32[S, J, T] each steering slot's row scales at its own code (0 elsewhere)
    vectors: jax.Array  # f32[J, H] the steering vectors
    patch: jax.Array  # i32[S, T] the patch that replaces each code's row (the last one given), -1: none
    patch_values: jax.Array  # f32[P, H]
    slot: jax.Array  # i32[S] the capture slot of each code (C: none asks for it)
    cap_rows: jax.Array  # i32[R]
    heads: jax.Array  # f32[L, T, Nq] the product of each layer's head-scale slots per row and head


def research_tables(ri: ResearchInputs, num_layers: int, num_heads: int) -> ResearchTables:
    n_codes = len(LAYER_SITES) * num_layers + 1
    t = ri.steer_scales.shape[1]
    code = jnp.arange(n_codes, dtype=jnp.int32)[:, None]  # [S, 1]
    scale = jnp.prod(jnp.where((ri.scale_codes[None, :] == code)[:, :, None], ri.scale_factors[None], 1.0), 1)
    steer = jnp.where((ri.steer_codes[None, :] == code)[:, :, None], ri.steer_scales[None], 0.0)
    rows = jnp.arange(t, dtype=jnp.int32)
    hit = (ri.patch_codes[None, :] == code)[:, :, None] & (ri.patch_rows[None, :, None] == rows)  # [S, P, T]
    patch_ids = jnp.arange(ri.patch_codes.shape[0], dtype=jnp.int32)[None, :, None]
    patch = jnp.max(jnp.where(hit, patch_ids, -1), axis=1, initial=-1)
    asks = ri.cap_codes[None, :] == code  # [S, C]; slot codes are unique (research_batch.py)
    slot = jnp.where(asks.any(axis=1), jnp.argmax(asks, axis=1), ri.cap_codes.shape[0]).astype(jnp.int32)
    layer = jnp.arange(num_layers, dtype=jnp.int32)
    head_hit = (ri.head_layers[:, None] == layer)[:, :, None] & (  # [K, L, Nq]
        ri.head_index[:, None] == jnp.arange(num_heads, dtype=jnp.int32)
    )[:, None, :]
    heads = jnp.prod(
        jnp.where(head_hit[:, :, None, :], ri.head_factors[:, None, :, None], 1.0), axis=0
    )  # [L, T, Nq]
    return ResearchTables(scale, steer, ri.steer_vectors, patch, ri.patch_values, slot, ri.cap_rows, heads)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SiteEdit:
    """What happens to one site's activation in this step (see the module docstring)."""

    tables: ResearchTables
    code: jax.Array  # i32[] the site's code: an array, so that every layer shares one trace (layer_trace)


def site_edit(tables: ResearchTables, code: int) -> SiteEdit:
    return SiteEdit(tables, jnp.asarray(code, jnp.int32))


def apply_edit(act: jax.Array, edit: SiteEdit | None) -> jax.Array:  # [T, H] -> [T, H]
    if edit is None:
        return act
    tb = edit.tables
    w = tb.steer[edit.code]  # f32[J, T]
    out = act.astype(jnp.float32) * tb.scale[edit.code][:, None]
    for j in range(w.shape[0]):  # unrolled, so the sum stays elementwise and fuses (a dot would not)
        out = out + w[j][:, None] * tb.vectors[j][None, :]
    patch = tb.patch[edit.code]  # i32[T]
    out = jnp.where((patch >= 0)[:, None], tb.patch_values[jnp.maximum(patch, 0)], out)
    return out.astype(act.dtype)


def head_factors(tables: ResearchTables, layer: int) -> jax.Array:  # f32[T, Nq]
    """Per row and query head, the product of the head-scale slots of `layer` (1 where none asks)."""
    return tables.heads[layer]


def empty_captures(ri: ResearchInputs, hidden: int, dtype) -> jax.Array:  # [C + 1, R, H]
    return jnp.zeros((ri.cap_codes.shape[0] + 1, ri.cap_rows.shape[0], hidden), dtype)


def capture(buf: jax.Array, tables: ResearchTables, code: int, act: jax.Array) -> jax.Array:
    """Writes act[cap_rows] ([R, H]) into the slot asking for `code` (slot C when none does)."""
    if buf.shape[0] == 1:  # no capture slots
        return buf
    rows = act[tables.cap_rows].astype(buf.dtype)  # [R, H]
    return jax.lax.dynamic_update_index_in_dim(buf, rows, tables.slot[code], 0)
