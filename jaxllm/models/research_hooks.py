"""Captures and steering compiled into the model step: the device half of jaxllm/research_params.py.

A step with research (`ResearchInputs`, arrays of static shape) runs a variant of the model step that
  - adds steering at layer sites: for site code c, add[T, H] = scale[:, rows] masked to the slots whose
    code is c, times their vectors (one [T, J] x [J, H] product per site and layer);
  - copies the activation of each captured site (code in `cap_codes`) at the rows `cap_rows` into its slot
    of a [C + 1, R, H] buffer (slot C takes what no slot asked for and is dropped).
Which sites and rows are data, not program: any mix of requests runs the variant of its bucket
(R rows, C slots, J steers, logits or not), never a new trace for new layers or sites.

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


@dataclass(frozen=True, slots=True)
class ResearchShape:
    """The static shape of a step's research inputs: one variant of the model step each."""

    rows: int  # R: captured rows of the step
    slots: int  # C: captured sites
    steers: int  # J: steering vectors
    logits: bool  # logits of the captured rows come back too


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ResearchInputs:
    cap_rows: jax.Array  # i32[R] rows of the step to capture (padding: 0, its values are never read)
    cap_codes: jax.Array  # i32[C] the site code of each capture slot, -1 unused
    steer_codes: jax.Array  # i32[J] the site code of each steering vector, -1 unused
    steer_vectors: jax.Array  # f32[J, H]
    steer_scales: jax.Array  # f32[J, T] per row of the step (0: the row's request does not steer)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.cap_rows.shape[0], self.cap_codes.shape[0], self.steer_codes.shape[0]


def steering(ri: ResearchInputs, code: int, dtype) -> jax.Array | None:  # [T, H] or None
    """What the steering vectors add at site `code`, per row; None when the step has no steering."""
    if ri.steer_codes.shape[0] == 0:
        return None
    w = jnp.where((ri.steer_codes == code)[:, None], ri.steer_scales, 0.0)  # f32[J, T]
    return jnp.einsum("jt,jh->th", w, ri.steer_vectors).astype(dtype)


def empty_captures(ri: ResearchInputs, hidden: int, dtype) -> jax.Array:  # [C + 1, R, H]
    r, c, _ = ri.shape
    return jnp.zeros((c + 1, r, hidden), dtype)


def capture(buf: jax.Array, ri: ResearchInputs, code: int, act: jax.Array) -> jax.Array:
    """Writes act[cap_rows] ([R, H]) into the slot asking for `code` (slot C when none does)."""
    c = ri.cap_codes.shape[0]
    if c == 0:
        return buf
    match = jnp.concatenate([ri.cap_codes == code, jnp.ones((1,), bool)])
    slot = jnp.argmax(match)  # the first slot with this code; C when none has it
    rows = act[ri.cap_rows].astype(buf.dtype)  # [R, H]
    return jax.lax.dynamic_update_index_in_dim(buf, rows, slot, 0)
