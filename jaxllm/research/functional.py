"""The bare functional model on a batch of prompts: logits and named activations at every position,
with optional additive perturbations at the same sites. No engine, no scheduler, no KV cache kept.

Data flow of `forward(module, params, layout, input_ids, perturbations)` (traceable; jit it):
  prompts (token-id lists) -> PromptLayout: one sequence per prompt, packed back to back into T rows
    (cu_q_lens), each with its own fresh pages of a single-use paged KV cache (page_size slots a page)
  -> the model's own `__call__` under `nn.intercept_methods`: after each decoder layer, attention block
     and MLP the interceptor adds the site's perturbation (packed from [N, L, d] to [T, d]) and records
     the result -> final norm (+ perturbation) -> compute_logits (+ perturbation)
  -> Activations: every site unpacked to [N, L, d], right-padded (rows past a prompt's length are 0).
Because the perturbation is added where the activation is produced, d(metric)/d(perturbation) at zero
is the gradient with respect to the activation itself (jaxllm/research/gradients.py). Prompts never
attend to each other (one sequence each), so per-prompt metrics summed give per-prompt gradients.

Site names (shared by every research API): "residual.i" (decoder layer i's output, before the final
norm), "attn_out.i" (the attention block's o_proj output, before the residual add), "mlp_out.i" (the
MLP's down_proj output, before the residual add), "final_norm" (what the LM head reads), "logits" (f32).

Attention always runs on the "reference" backend (plain jnp, differentiable on any platform), whatever
backend the served engine uses; the weights are the served ones.
  N: prompts   L: longest prompt   T: total tokens   H: hidden size   V: vocabulary
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from jaxllm.models.opt import OPTMLP, OPTAttention, OPTDecoderLayer
from jaxllm.research_params import LAYER_SITES, MODEL_SITES
from jaxllm.research_params import parse_site as parse_site_name

# The module classes whose `__call__` output is each layer site (outputs of the first two are
# (activation, kv_cache) pairs, of the MLP the activation alone).
_SITE_OF_MODULE = {
    LlamaDecoderLayer: "residual",
    OPTDecoderLayer: "residual",
    LlamaAttention: "attn_out",
    OPTAttention: "attn_out",
    LlamaMLP: "mlp_out",
    OPTMLP: "mlp_out",
}
PAGE_SIZE = 16


# ---- sites ------------------------------------------------------------------------------------------
def parse_site(site: str, num_layers: int) -> tuple[str, int | None]:
    """("residual", 3) for "residual.3", ("logits", None) for "logits"; ValueError naming the site (the
    names of jaxllm/research_params.py, which the engine's captures use)."""
    parsed = parse_site_name(site, "site")
    if parsed.layer is not None and parsed.layer >= num_layers:
        raise ValueError(
            f"site {site!r}: layer {parsed.layer} is out of range, the model has {num_layers} layers"
        )
    return parsed.kind, parsed.layer


def check_sites(sites: str | Sequence[str], num_layers: int) -> tuple[str, ...]:
    """The sites as a tuple, each validated, without duplicates (order kept)."""
    sites = (sites,) if isinstance(sites, str) else tuple(sites)
    if not sites:
        raise ValueError("sites must name at least one site")
    for s in sites:
        parse_site(s, num_layers)
    return tuple(dict.fromkeys(sites))


def all_sites(num_layers: int) -> tuple[str, ...]:
    return tuple(f"{k}.{i}" for i in range(num_layers) for k in LAYER_SITES) + MODEL_SITES


# ---- the model --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionalModel:
    """A loaded model as a pure function: the module (reference attention, layers traced one by one),
    its parameter tree (the served arrays, not copies) and its architecture."""

    module: nn.Module
    params: Any  # nested dict of jax.Array (jaxllm/models/llama.py lists the tree)
    arch: ModelArchConfig

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype: the float leaves' (a quantized model's weights are integers)."""
        return _float_dtype(self.params)


def functional_model(model) -> FunctionalModel:
    """The FunctionalModel of `jaxllm.LLM()`, its `LLMEngine`, a loader's `LoadedModel`, or itself."""
    if isinstance(model, FunctionalModel):
        return model
    loaded = model
    if hasattr(loaded, "llm_engine"):  # jaxllm.LLM
        loaded = loaded.llm_engine
    if hasattr(loaded, "loaded"):  # LLMEngine
        loaded = loaded.loaded
    if not all(hasattr(loaded, f) for f in ("module", "params", "arch")):
        raise TypeError(
            f"model must be a jaxllm.LLM, an LLMEngine, a LoadedModel or a FunctionalModel, "
            f"got {type(model).__name__}"
        )
    tp = getattr(loaded.module, "tp_size", 1)
    if tp != 1:
        # Its fused q|k|v layout is per shard and attention splits it only inside the engine's mesh.
        raise ValueError(
            f"model: loaded with tensor_parallel_size={tp}; the functional model runs on one device, "
            "so load it with tensor_parallel_size=1"
        )
    module = loaded.module.clone(parent=None, attn_backend="reference", trace_layers_once=False)
    return FunctionalModel(module, loaded.params, loaded.arch)


# ---- prompts ----------------------------------------------------------------------------------------
def check_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, name: str = "prompts"
) -> list[list[int]]:
    """Token-id prompts as lists of ints; ValueError naming the prompt at fault."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"{name} must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or not isinstance(p, Sequence | np.ndarray) or len(p) == 0:
            raise ValueError(f"{name}[{i}] must be a non-empty list of token ids (tokenize text first)")
        ids = [int(t) for t in p]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}[{i}]: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out


@dataclass(frozen=True)
class PromptLayout:
    """Where each prompt's tokens sit in the packed batch and in the single-use KV cache (host side,
    static under jit: one compiled program per distinct tuple of lengths)."""

    lengths: tuple[int, ...]
    page_size: int = PAGE_SIZE

    @property
    def num_prompts(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt i32[T], position i32[T]) of each packed row."""
        seq = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(self.lengths)])
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in self.lengths])
        return seq, pos

    @property
    def pages_per_prompt(self) -> int:
        return -(-self.max_len // self.page_size)

    def metadata(self) -> AttentionMetadata:
        """Prompt i owns pages [i * B, (i + 1) * B); every row is real, so no slot is -1."""
        seq, pos = self.rows
        b = self.pages_per_prompt
        block_tables = np.arange(self.num_prompts * b, dtype=np.int32).reshape(self.num_prompts, b)
        slots = block_tables[seq, pos // self.page_size] * self.page_size + pos % self.page_size
        cu = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)
        return AttentionMetadata(
            positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(slots.astype(np.int32)),
            block_tables=jnp.asarray(block_tables),
            kv_lens=jnp.asarray(np.asarray(self.lengths, np.int32)),
            cu_q_lens=jnp.asarray(cu),
            num_seqs=jnp.asarray([self.num_prompts], jnp.int32),
        )

    def kv_caches(self, arch: ModelArchConfig, dtype) -> list[tuple[jax.Array, jax.Array]]:
        """Zeroed pages for every layer: ([Hkv, P, PS, D], [Hkv, P, PS, D])."""
        shape = (arch.num_kv_heads, self.num_prompts * self.pages_per_prompt, self.page_size, arch.head_dim)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(arch.num_layers)]

    def pack(self, x: jax.Array) -> jax.Array:  # [N, L, ...] -> [T, ...]
        seq, pos = self.rows
        return x[seq, pos]

    def unpack(self, x: jax.Array) -> jax.Array:  # [T, ...] -> [N, L, ...], zero past each prompt's end
        seq, pos = self.rows
        return jnp.zeros((self.num_prompts, self.max_len, *x.shape[1:]), x.dtype).at[seq, pos].set(x)

    def packed_ids(self, prompts: list[list[int]]) -> np.ndarray:  # i32[T] packed
        return np.concatenate([np.asarray(p, np.int32) for p in prompts])


# ---- activations ------------------------------------------------------------------------------------
@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=["lengths"])
@dataclass(frozen=True)
class Activations:
    """Named activations of a batch of prompts, each [N, L, d] right-padded with zeros (d: H, or V for
    "logits"). What a metric receives (inside the trace) and what `run_model` returns."""

    values: dict[str, jax.Array]  # site -> [N, L, d]
    lengths: tuple[int, ...]  # each prompt's length

    def __getitem__(self, site: str) -> jax.Array:
        if site not in self.values:
            raise KeyError(f"site {site!r} was not captured; captured: {', '.join(self.values)}")
        return self.values[site]

    def __contains__(self, site: str) -> bool:
        return site in self.values

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(self.values)

    @property
    def mask(self) -> np.ndarray:  # bool[N, L]: True at a prompt's real positions
        return np.arange(max(self.lengths))[None, :] < np.asarray(self.lengths)[:, None]

    def last(self, site: str) -> jax.Array:  # [N, d]: each prompt's last position
        n = len(self.lengths)
        return self[site][np.arange(n), np.asarray(self.lengths) - 1]

    def prompt(self, site: str, i: int) -> jax.Array:  # [len_i, d]: prompt i without its padding
        return self[site][i, : self.lengths[i]]


def site_width(site: str, arch: ModelArchConfig) -> int:
    """d of a site's activations: the vocabulary for logits, what the LM head reads for final_norm."""
    if site == "logits":
        return arch.vocab_size
    if site == "final_norm":
        return arch.word_embed_proj_dim or arch.hidden_size
    return arch.hidden_size


def _layer_of(path: tuple[str, ...]) -> int:
    """The decoder layer index a module sits under: `("layers_3", "mlp")` -> 3."""
    for part in path:
        if part.startswith("layers_"):
            return int(part[len("layers_") :])
    raise AssertionError(f"no decoder layer in module path {path}")


def forward(
    module: nn.Module,
    params,
    layout: PromptLayout,
    input_ids: jax.Array,  # i32[T] packed
    perturbations: Mapping[str, jax.Array] | None = None,  # site -> [N, L, d], added where produced
) -> Activations:
    """Every site's activations (module docstring). Traceable; sites nobody reads are dead code under jit."""
    arch = module.arch
    deltas = {site: layout.pack(d) for site, d in (perturbations or {}).items()}  # site -> [T, d]
    captured: dict[str, jax.Array] = {}  # site -> [T, d]

    def record(site: str, x: jax.Array) -> jax.Array:
        if site in deltas:
            x = x + deltas[site].astype(x.dtype)
        captured[site] = x
        return x

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        kind = _SITE_OF_MODULE.get(type(context.module))
        if kind is None or context.method_name != "__call__":
            return out
        site = f"{kind}.{_layer_of(context.module.path)}"
        if kind == "mlp_out":
            return record(site, out)
        x, kv_cache = out
        return record(site, x), kv_cache

    kv = layout.kv_caches(arch, _float_dtype(params))
    with nn.intercept_methods(interceptor):
        hidden, _ = module.apply({"params": params}, input_ids, kv, layout.metadata())  # [T, H]
    hidden = record("final_norm", hidden)
    record("logits", module.apply({"params": params}, hidden, method="compute_logits"))  # f32[T, V]
    return Activations({s: layout.unpack(x) for s, x in captured.items()}, layout.lengths)


def _float_dtype(params) -> jnp.dtype:
    return next(
        x.dtype
        for x in jax.tree.leaves(params)
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 1
    )


@functools.partial(jax.jit, static_argnames=("module", "layout", "sites"))
def _run(params, input_ids, perturbations, *, module, layout, sites):
    acts = forward(module, params, layout, input_ids, perturbations)
    return {s: acts[s] for s in sites}


def check_perturbations(
    perturbations: Mapping[str, Any] | None, layout: PromptLayout, arch: ModelArchConfig, dtype
) -> dict[str, jax.Array]:
    """Each perturbation as a [N, L, d] array of the site's dtype; ValueError naming the site."""
    out = {}
    for site, d in (perturbations or {}).items():
        parse_site(site, arch.num_layers)
        d = jnp.asarray(d, jnp.float32 if site == "logits" else dtype)
        want = (layout.num_prompts, layout.max_len, site_width(site, arch))
        if d.shape != want:
            raise ValueError(
                f"perturbations[{site!r}] has shape {d.shape}; expected {want} (prompts, positions, width)"
            )
        out[site] = d
    return out


def run_model(
    model,
    prompts: Sequence[Sequence[int]],
    sites: str | Sequence[str] = ("logits",),
    perturbations: Mapping[str, Any] | None = None,
) -> Activations:
    """The activations at `sites` of each token-id prompt, [N, L, d] right-padded (`Activations`).

    `perturbations`: site -> array [N, L, d] added to that activation where it is produced, so it
    flows into everything downstream (an activation patch is `patched - clean` at the chosen rows).
    `model`: `jaxllm.LLM()`, its engine, a LoadedModel or a FunctionalModel."""
    fm = functional_model(model)
    prompts = check_prompts(prompts, fm.arch.vocab_size)
    sites = check_sites(sites, fm.arch.num_layers)
    layout = PromptLayout(tuple(len(p) for p in prompts))
    deltas = check_perturbations(perturbations, layout, fm.arch, fm.dtype)
    ids = jnp.asarray(layout.packed_ids(prompts))
    values = _run(fm.params, ids, deltas, module=fm.module, layout=layout, sites=sites)
    return Activations(values, layout.lengths)
