"""Normalization layers (statistics in float32, output in the input dtype).

RMSNorm (Llama family; param `scale` [H]), GemmaRMSNorm (Gemma: the checkpoint's weight is zero-centred,
the output x_hat * (1 + weight), all in float32 before the cast) and LayerNorm (OPT; params `scale`, `bias` [H]).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    dim: int
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        scale = self.param("scale", nn.initializers.ones, (self.dim,))
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * xf.astype(x.dtype)


class GemmaRMSNorm(nn.Module):
    dim: int
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        scale = self.param("scale", nn.initializers.zeros, (self.dim,))
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nn.Module):
    dim: int
    eps: float = 1e-5
    affine: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        if self.affine:
            y = y * self.param("scale", nn.initializers.ones, (self.dim,))
            y = y + self.param("bias", nn.initializers.zeros, (self.dim,))
        return y
