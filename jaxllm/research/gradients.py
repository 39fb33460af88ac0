"""Gradients of a scalar metric with respect to named activations, and attribution patching, on the
served weights through the bare functional model (jaxllm/research/functional.py).

Data flow of `activation_gradients(model, prompts, metric, sites)`:
  a zero perturbation [N, L, d] per site -> `forward` adds each where its activation is produced ->
  `metric(Activations)` -> scalar; `jax.value_and_grad` over the perturbations at zero is
  d metric / d activation for every site, prompt and position (the perturbation enters exactly where the
  activation does, so the chain rule sees the activation itself). One compiled program per (model,
  prompt lengths, metric, sites); the same metric object reuses it.

The metric receives `Activations` of every site (unused ones cost nothing under jit): a logit difference
is `acts.last("logits")[:, a] - acts.last("logits")[:, b]` summed over prompts, a linear probe
`acts["residual.10"] @ w`. It must return a scalar. Prompts never attend to each other, so the gradient
of a sum of per-prompt metrics is, at each prompt's rows, that prompt's own gradient.

`attribution_patching(model, clean_prompts, corrupt_prompts, metric, sites)` runs both batches and
estimates, for each site, prompt and position, what patching the corrupt activation into the clean run
there would do to the metric, to first order (the attribution-patching formula):
    estimate[site][n, p] = grad_clean[site][n, p, :] . (act_corrupt[site][n, p, :] - act_clean[site][n, p, :])
                         ~ metric(clean run with that one activation replaced by the corrupt one) - metric(clean)
The sign convention is "corrupt minus clean": a positive estimate means the patch raises the metric. For
the other direction (clean activations patched into the corrupt run) swap the two prompt lists. The
estimate is exact where the metric is linear in the activation downstream of it (e.g. "final_norm" or
"logits" with a logit difference); elsewhere it is a first-order approximation, cheap for every site at
once (two forward and two backward passes), to be confirmed by real patching (`run_model` with a
perturbation) at the sites it ranks highest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelArchConfig
from jaxllm.research.functional import (
    Activations,
    PromptLayout,
    check_prompts,
    check_sites,
    forward,
    functional_model,
    site_width,
)

Metric = Callable[[Activations], jax.Array]  # the activations of every site -> a scalar


@dataclass(frozen=True)
class ActivationGradients:
    value: float  # the metric at the unperturbed activations
    gradients: dict[str, np.ndarray]  # site -> [N, L, d]: d metric / d activation (0 past a prompt's end)
    activations: dict[str, np.ndarray]  # site -> [N, L, d]: the activations the gradients were taken at
    lengths: tuple[int, ...]  # each prompt's length


@dataclass(frozen=True)
class AttributionPatching:
    estimates: dict[str, np.ndarray]  # site -> f32[N, L]: first-order metric change (module docstring)
    clean: ActivationGradients  # the clean run: its metric value, gradients and activations
    corrupt: ActivationGradients  # the corrupt run, the same
    lengths: tuple[int, ...]

    @property
    def clean_value(self) -> float:
        return self.clean.value

    @property
    def corrupt_value(self) -> float:
        return self.corrupt.value


def check_differentiable(arch: ModelArchConfig) -> None:
    """W8A8 schemes round the activations to 8 bits inside every projection; the rounding's derivative
    is zero, so every gradient through it would be zero. Refuse them rather than return zeros."""
    schemes = [arch.quant]
    for lq in arch.layer_quant or ():
        schemes += [lq.default, *(s for _, s in lq.overrides)]
    quantized = sorted({s.method for s in schemes if s is not None and not s.weight_only})
    if quantized:
        raise ValueError(
            f"model: its {', '.join(quantized)} projections quantize activations (W8A8), whose rounding has "
            "zero gradient; load the checkpoint unquantized (or weight-only) to take gradients"
        )


@functools.partial(jax.jit, static_argnames=("module", "layout", "metric"))
def _value_and_grad(params, input_ids, zeros, *, module, layout, metric):
    def scalar(deltas):
        acts = forward(module, params, layout, input_ids, deltas)
        value = jnp.asarray(metric(acts))
        if value.shape != ():
            raise ValueError(f"metric must return a scalar; it returned shape {value.shape}")
        return value.astype(jnp.float32), {s: acts[s] for s in deltas}

    (value, acts), grads = jax.value_and_grad(scalar, has_aux=True)(zeros)
    return value, grads, acts


def activation_gradients(
    model, prompts: Sequence[Sequence[int]], metric: Metric, sites: str | Sequence[str]
) -> ActivationGradients:
    """d metric / d activation at each of `sites` ("residual.3", "attn_out.3", "mlp_out.3", "final_norm",
    "logits") for every prompt and position, and the metric's value (module docstring).

    `model`: `jaxllm.LLM()`, its engine, a LoadedModel or a FunctionalModel; `prompts`: token-id lists;
    `metric(acts: Activations) -> scalar`."""
    fm = functional_model(model)
    check_differentiable(fm.arch)
    prompts = check_prompts(prompts, fm.arch.vocab_size)
    sites = check_sites(sites, fm.arch.num_layers)
    if not callable(metric):
        raise ValueError(f"metric must be a function of the activations, got {type(metric).__name__}")
    layout = PromptLayout(tuple(len(p) for p in prompts))
    return _gradients(fm, layout, prompts, metric, sites)


def _gradients(fm, layout: PromptLayout, prompts, metric: Metric, sites) -> ActivationGradients:
    shape = (layout.num_prompts, layout.max_len)
    zeros = {
        s: jnp.zeros((*shape, site_width(s, fm.arch)), jnp.float32 if s == "logits" else fm.dtype)
        for s in sites
    }
    ids = jnp.asarray(layout.packed_ids(prompts))
    value, grads, acts = _value_and_grad(
        fm.params, ids, zeros, module=fm.module, layout=layout, metric=metric
    )
    grads, acts = jax.device_get((grads, acts))
    return ActivationGradients(
        float(value), {s: grads[s] for s in sites}, {s: acts[s] for s in sites}, layout.lengths
    )


def attribution_patching(
    model,
    clean_prompts: Sequence[Sequence[int]],
    corrupt_prompts: Sequence[Sequence[int]],
    metric: Metric,
    sites: str | Sequence[str],
) -> AttributionPatching:
    """First-order estimates of the metric change from patching each site's corrupt activation into the
    clean run, per prompt and position: grad_clean . (corrupt - clean) (sign convention in the module
    docstring). `corrupt_prompts[i]` must have the length of `clean_prompts[i]`, so positions align."""
    fm = functional_model(model)
    check_differentiable(fm.arch)
    clean = check_prompts(clean_prompts, fm.arch.vocab_size, "clean_prompts")
    corrupt = check_prompts(corrupt_prompts, fm.arch.vocab_size, "corrupt_prompts")
    if len(corrupt) != len(clean):
        raise ValueError(f"corrupt_prompts has {len(corrupt)} prompts; clean_prompts has {len(clean)}")
    for i, (c, k) in enumerate(zip(clean, corrupt, strict=True)):
        if len(c) != len(k):
            raise ValueError(
                f"corrupt_prompts[{i}] has {len(k)} tokens and clean_prompts[{i}] {len(c)}: "
                "positions must align to patch one into the other"
            )
    sites = check_sites(sites, fm.arch.num_layers)
    if not callable(metric):
        raise ValueError(f"metric must be a function of the activations, got {type(metric).__name__}")
    layout = PromptLayout(tuple(len(p) for p in clean))
    # Both runs share one compiled program (same lengths, metric and sites); the corrupt run's gradients
    # come with it and are kept for the opposite patching direction.
    g_clean = _gradients(fm, layout, clean, metric, sites)
    g_corrupt = _gradients(fm, layout, corrupt, metric, sites)
    estimates = {
        s: np.einsum(
            "nld,nld->nl",
            g_clean.gradients[s].astype(np.float32),
            g_corrupt.activations[s].astype(np.float32) - g_clean.activations[s].astype(np.float32),
        )
        for s in sites
    }
    return AttributionPatching(estimates, g_clean, g_corrupt, layout.lengths)
