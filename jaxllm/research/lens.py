"""The logit lens: what the model would predict if it stopped after layer i.

The engine captures the residual stream after the chosen layers ("residual.i", SamplingParams.research);
here each captured row goes through the model's own final norm and LM head (the loaded module's `norm`
and `compute_logits`, with the served params: tied to the embedding when the model ties them), so the
lens of the last layer is exactly the logits the engine computed, and the lens of a middle layer is
transformers' `lm_head(norm(output_hidden_states[i + 1]))`.

    captures (residual.i: [P, H] for each chosen layer)
      -> stack [Ly * P, H] -> padded to a power of two rows (one compiled program per bucket)
      -> norm -> LM head -> f32[Ly, P, V] -> top-k per layer and position

`logit_lens(llm, prompt, layers)` runs the prompt through the engine and lenses it; `apply_logit_lens`
lenses captures a request already has; `lens_logits` is the bare norm + head on any [N, H].
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.outputs import Captures, RequestOutput
from jaxllm.research_params import ResearchParams, parse_site
from jaxllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LogitLens:
    """The lens of one request: `logits[j, q]` is what layer `layers[j]`'s residual at input position
    `positions[q]` predicts for position `positions[q] + 1`."""

    layers: list[int]  # ascending
    positions: list[int]  # the model's input positions, ascending
    token_ids: list[int] | None  # the input token at each of `positions` (None when not known)
    logits: np.ndarray  # f32[len(layers), len(positions), V]

    def top_tokens(self, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
        """(ids i32[Ly, P, k], logprobs f32[Ly, P, k]), most likely first, per layer and position."""
        if not 1 <= k <= self.logits.shape[-1]:
            raise ValueError(f"k={k} must be in 1..{self.logits.shape[-1]} (the vocabulary size)")
        part = np.argpartition(-self.logits, k - 1, axis=-1)[..., :k]  # the k largest, unordered
        order = np.argsort(-np.take_along_axis(self.logits, part, axis=-1), axis=-1, kind="stable")
        ids = np.take_along_axis(part, order, axis=-1).astype(np.int32)  # i32[Ly, P, k]
        logz = _logsumexp(self.logits)  # f32[Ly, P, 1]
        logprobs = np.take_along_axis(self.logits, ids, axis=-1) - logz  # f32[Ly, P, k]
        return ids, logprobs.astype(np.float32)


def _logsumexp(x: np.ndarray) -> np.ndarray:  # f32[..., V] -> f32[..., 1]
    m = np.max(x, axis=-1, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _loaded(llm):
    loaded = llm.llm_engine.loaded
    if not getattr(loaded.module, "supports_research", False):
        raise ValueError(
            f"logit lens: {loaded.arch.architecture or 'this model'} has no research sites (Llama family only)"
        )
    return loaded


@functools.partial(jax.jit, static_argnames="module")
def _norm_and_head(module, params, hidden):  # [N, H] -> f32[N, V]
    return module.apply({"params": params}, hidden, method=lambda m, h: m.compute_logits(m.norm(h)))


def lens_logits(llm, hidden: np.ndarray) -> np.ndarray:
    """f32[N, V]: the model's final norm and LM head applied to residual rows `hidden` [N, H] (cast to
    the model's dtype first, as the engine's rows are). Rows are padded to a power of two so that lensing
    many requests of different lengths compiles a few programs, not one per length."""
    loaded = _loaded(llm)
    hidden = np.asarray(hidden)
    h = loaded.arch.hidden_size
    if hidden.ndim != 2 or hidden.shape[1] != h:
        raise ValueError(f"hidden: shape {hidden.shape} is not [rows, {h}] (the model's hidden size)")
    n = hidden.shape[0]
    if n == 0:
        return np.zeros((0, loaded.arch.vocab_size), np.float32)
    padded = np.zeros((1 << (n - 1).bit_length(), h), hidden.dtype)  # [N', H], N' a power of two
    padded[:n] = hidden
    rows = jnp.asarray(padded, dtype=loaded.dtype)
    return np.asarray(_norm_and_head(loaded.module, loaded.params, rows))[:n]


def residual_layers(captures: Captures) -> list[int]:
    """The layers whose residual stream `captures` holds, ascending."""
    sites = [parse_site(s) for s in captures.arrays]
    return sorted(s.layer for s in sites if s.kind == "residual")


def apply_logit_lens(
    llm, captures: Captures, token_ids: Sequence[int] | None = None, layers: Sequence[int] | None = None
) -> LogitLens:
    """The lens of the residual sites in `captures` (all of them, or `layers`); `token_ids` is the
    request's whole sequence (prompt then generated tokens), to record the input token at each position."""
    have = residual_layers(captures)
    layers = have if layers is None else sorted(set(layers))
    missing = [i for i in layers if i not in have]
    if missing or not layers:
        raise ValueError(f"layers={list(layers)}: the captures hold the residual of layers {have} only")
    stacked = np.stack([np.asarray(captures.arrays[f"residual.{i}"]) for i in layers])  # [Ly, P, H]
    ly, p, h = stacked.shape
    logits = lens_logits(llm, stacked.reshape(ly * p, h)).reshape(ly, p, -1)  # f32[Ly, P, V]
    tokens = None
    if token_ids is not None:
        token_ids = list(token_ids)
        if captures.positions and captures.positions[-1] >= len(token_ids):
            raise ValueError(
                f"token_ids: {len(token_ids)} tokens, but the captures reach position {captures.positions[-1]}"
            )
        tokens = [int(token_ids[q]) for q in captures.positions]
    return LogitLens(list(layers), list(captures.positions), tokens, logits)


def sequence_token_ids(out: RequestOutput, sample: int = 0) -> list[int]:
    """A finished request's whole sequence: prompt tokens then sample `sample`'s generated tokens (the
    token at input position p is element p)."""
    return list(out.prompt_token_ids) + list(out.outputs[sample].token_ids)


def logit_lens(
    llm, prompt: str | Sequence[int], layers: Sequence[int] | None = None, *, with_logits: bool = False
) -> LogitLens | tuple[LogitLens, np.ndarray]:
    """Runs `prompt` (text or token ids) through the engine once, capturing the residual stream after
    `layers` (default: every layer) at every prompt position, and lenses it. With `with_logits`, also
    returns the logits the engine computed at those positions (f32[P, V]), the lens's last-layer reference."""
    n = llm.llm_engine.loaded.arch.num_layers
    layers = list(range(n)) if layers is None else sorted(set(int(i) for i in layers))
    capture = [f"residual.{i}" for i in layers] + (["logits"] if with_logits else [])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        research=ResearchParams(capture=capture, capture_positions="prompt"),
    )
    if isinstance(prompt, str):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    else:
        (out,) = llm.generate(None, params, prompt_token_ids=[list(prompt)], use_tqdm=False)
    captures = out.outputs[0].captures
    lens = apply_logit_lens(llm, captures, sequence_token_ids(out), layers)
    if with_logits:
        return lens, np.asarray(captures.arrays["logits"], np.float32)
    return lens
