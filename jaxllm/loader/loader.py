"""`load_model(spec)` = `load_weights(open_model(spec))`: resolve where the model comes from and read its
configuration (open_model: no weights touched, so the engine settles its limits first), then build the
module and fill its params (load_weights).

  spec.model None      -> embedded GGUF (SmolLM2-135M-Instruct)
  "*.gguf" file        -> gguf_loader (Q8_0 / Q4_* as int8 / } with spec.checkpoint_dir: restore the orbax
                          int4, other types dequantized)    } cache if it matches, else convert and save
  folder with config   -> safetensors_loader                 }
  preset name + dummy  -> dummy (random, on device)
  Hub id "ORG/NAME"    -> its snapshot folder, fetched first (resolve_model: jaxllm/hub.py)
-> LoadedModel(module, params, arch, tokenizer, ...). Load times are logged on logger "jaxllm".

dtype "auto": the checkpoint's torch_dtype (bfloat16/float16 kept as is); float32 checkpoints and
GGUF files (dequantized weights, int4/int8 scales) stay float32 on the CPU and become bfloat16 on an
accelerator (what a vLLM user gets: half precision on the GPU). An explicit dtype always wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ModelSpec
from jaxllm.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from jaxllm.hub import ModelNotFoundError, resolve_hub_model
from jaxllm.loader.checkpoint import CheckpointCache
from jaxllm.loader.dummy import dummy_params
from jaxllm.loader.params_builder import ShardingFn
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.presets import PRESETS, get_preset
from jaxllm.models.registry import abstract_params, build_model, fused_groups
from jaxllm.quantization.config import checkpoint_kv_cache_scales, quant_scheme

logger = logging.getLogger("jaxllm")


@dataclass(frozen=True)
class LoadedModel:
    module: nn.Module
    params: Any  # nested dict of jax.Array (see the model file docstring for the tree)
    arch: ModelArchConfig
    tokenizer: Any  # transformers tokenizer, or None for a dummy preset without spec.tokenizer
    model_name: str
    source: str  # file, folder or preset name the weights came from
    load_time_s: float
    from_cache: bool  # True when restored from the orbax cache (spec.checkpoint_dir)

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype: the float leaves' (a quantized model's weights are integer or fp8)."""
        return next(
            x.dtype
            for x in jax.tree.leaves(self.params)
            if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 1
        )

    @property
    def weight_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.params))


def resolve_dtype(requested: str, checkpoint_dtype: str) -> jnp.dtype:
    if requested != "auto":
        return jnp.dtype(requested)
    if checkpoint_dtype in ("bfloat16", "float16"):
        return jnp.dtype(checkpoint_dtype)
    return jnp.dtype("float32" if jax.default_backend() == "cpu" else "bfloat16")


def source_kind(spec: ModelSpec) -> tuple[str, str]:
    """(kind, path): kind in gguf / hf / dummy."""
    model = spec.model if spec.model is not None else embedded_model_path()
    if spec.load_format == "dummy":
        if model in PRESETS:
            return "dummy", model
        if os.path.isdir(model):
            return "dummy", model
        raise ValueError(
            f"load_format='dummy' needs a preset ({', '.join(sorted(PRESETS))}), an HF folder or a Hub model id, "
            f"got {model!r}"
        )
    if model in PRESETS:
        raise ValueError(f"{model!r} is a random-weight preset: use load_format='dummy' with it")
    if model.endswith(".gguf") or spec.load_format == "gguf":
        if not os.path.isfile(model):
            raise ModelNotFoundError(f"GGUF file {model} does not exist")
        return "gguf", model
    if os.path.isdir(model):
        return "hf", model
    raise ModelNotFoundError(
        f"model {model!r} is neither an existing folder, a .gguf file, a preset ({', '.join(sorted(PRESETS))}) "
        "nor a Hugging Face Hub model id"
    )


def _model_name(spec: ModelSpec, path: str) -> str:
    if spec.model is None:
        return EMBEDDED_MODEL_NAME
    if spec.name is not None:
        return spec.name
    return os.path.basename(os.path.normpath(path)).removesuffix(".gguf")


@dataclass(frozen=True)
class ModelSource:
    """A model before its weights: where it comes from and its architecture (config files or the GGUF
    header), so the engine can settle its configuration before the slow part of a load."""

    spec: ModelSpec
    kind: str  # "gguf" | "hf" | "dummy"
    path: str  # file, folder or preset name
    hf_config: dict  # HF-style config (for GGUF: made from its metadata)
    arch: ModelArchConfig
    tp_size: int  # the shards the fused projections are laid out for (models/fused_projections.py)
    cache: CheckpointCache | None  # orbax cache of converted params (spec.checkpoint_dir)
    from_cache: bool  # the cache is valid and will be restored
    reader: Any  # the open GGUFHeader when the weights come from a GGUF file, else None
    open_s: float  # seconds spent reading the header and configs


def open_model(spec: ModelSpec, tp_size: int = 1) -> ModelSource:
    """Resolve the source and read its configuration; touches no weights."""
    from jaxllm.loader.gguf_loader import describe_projections, gguf_hf_config, gguf_layer_quant, open_gguf
    from jaxllm.loader.safetensors_loader import read_hf_config

    start = time.perf_counter()
    kind, path = source_kind(spec)
    if kind == "gguf" and spec.quantization not in (None, "gguf"):
        raise ValueError(
            f"quantization={spec.quantization!r} (--quantization) does not apply to the GGUF file {path}, "
            "whose tensor types say how it is quantized; leave the flag out or give 'gguf'"
        )
    cache = (
        CheckpointCache(
            spec.checkpoint_dir, path, spec.dtype, layout=params_layout(tp_size, spec.quantization, kind)
        )
        if spec.checkpoint_dir and kind != "dummy"
        else None
    )
    from_cache = cache is not None and cache.valid()
    if spec.load_format == "orbax" and not from_cache:
        raise ValueError(
            f"load_format='orbax' needs checkpoint_dir with a cache converted from {path}; "
            "load once with load_format='auto' and checkpoint_dir set"
        )
    reader = None
    if from_cache:
        hf_config = cache.hf_config
    elif kind == "gguf":
        reader = open_gguf(path)
        hf_config = gguf_hf_config(reader, path)
    elif os.path.isdir(path):
        hf_config = read_hf_config(path)
    else:
        hf_config = get_preset(path)
    arch = ModelArchConfig.from_hf(hf_config)
    scheme = quant_scheme(hf_config, spec.quantization, path, dummy=kind == "dummy")
    if spec.quantization == "gguf" and kind != "gguf":
        raise ValueError(f"quantization='gguf' (--quantization) needs a .gguf file, got {path!r}")
    if checkpoint_kv_cache_scales(hf_config, path):
        arch = dataclasses.replace(arch, kv_cache_scales=True)
    if scheme is not None:
        arch = dataclasses.replace(arch, quant=scheme)
        logger.info("%s: quantized layers: %s", path, scheme.describe())
    if kind == "gguf":
        arch = dataclasses.replace(arch, layer_quant=gguf_layer_quant(hf_config, path))
        logger.info("%s: GGUF projections: %s", path, describe_projections(hf_config))
    return ModelSource(
        spec, kind, path, hf_config, arch, tp_size, cache, from_cache, reader, time.perf_counter() - start
    )


def load_model(
    spec: ModelSpec,
    attn_backend: str = "reference",
    sharding_fn: ShardingFn | None = None,
    tp_size: int = 1,
) -> LoadedModel:
    """`sharding_fn(path, ShapeDtypeStruct) -> Sharding` optionally places each parameter as it loads;
    `tp_size`: the shards the model's fused projections are laid out for (models/fused_projections.py).
    A Hub model id is fetched first (resolve_model)."""
    return load_weights(open_model(resolve_model(spec), tp_size), attn_backend, sharding_fn)


def resolve_model(spec: ModelSpec) -> ModelSpec:
    """`spec` with a Hugging Face Hub id fetched (or found in the cache) and named by its local snapshot
    folder (jaxllm/hub.py); a path that exists, a preset or a .gguf path stays as it is."""
    return resolve_hub_model(spec, local_names=PRESETS)


def load_weights(
    source: ModelSource, attn_backend: str = "reference", sharding_fn: ShardingFn | None = None
) -> LoadedModel:
    """Build the module for `attn_backend` and fill its params from `source` (see load_model)."""
    from jaxllm.loader.gguf_loader import load_gguf_params
    from jaxllm.loader.safetensors_loader import load_safetensors_params

    start = time.perf_counter() - source.open_s
    spec, kind, path, arch, cache = source.spec, source.kind, source.path, source.arch, source.cache
    from_cache = source.from_cache
    module = build_model(arch, attn_backend, source.tp_size)
    groups = fused_groups(module)
    dtype = resolve_dtype(spec.dtype, arch.dtype)
    abstract = abstract_params(module, dtype)

    # The tokenizer loads on a thread while the weights load: importing transformers (which imports torch)
    # and parsing a 128K-entry tokenizer.json take seconds of host time the device transfers do not need.
    pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer")
    tokenizer_future = pool.submit(_timed, _load_tokenizer, spec, kind, path, cache if from_cache else None)
    pool.shutdown(wait=False)
    params = None
    if kind == "dummy":
        params = dummy_params(abstract, spec.seed, sharding_fn)
    elif from_cache:
        params = _restore_or_none(cache, _with_shardings(abstract, sharding_fn))
        from_cache = params is not None  # a corrupt cache: convert from the source, write it again (below)
    if params is not None:
        pass
    elif kind == "gguf":
        from jaxllm.loader.gguf_loader import open_gguf

        gguf_arch = source.hf_config["gguf_architecture"]
        reader = source.reader or open_gguf(path)  # not opened when the cache was expected to restore
        params = load_gguf_params(reader, path, arch, gguf_arch, abstract, sharding_fn, groups)
    else:
        params = load_safetensors_params(path, arch, abstract, sharding_fn, groups)
    jax.block_until_ready(params)
    weights_s = time.perf_counter() - start

    tokenizer, tokenizer_s = tokenizer_future.result()
    if cache is not None and not from_cache:
        _save_or_log(cache, params, source.hf_config, tokenizer)
    load_time = time.perf_counter() - start
    name = _model_name(spec, path)
    logger.info(
        "loaded %s (%s, %s, %s%s) in %.2f s: %.2f GiB of weights (%.2f s, tokenizer %.2f s alongside, %s)",
        name, arch.architecture, kind, dtype.name, f", {arch.quant.describe()}" if arch.quant else "",
        load_time, sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30, weights_s, tokenizer_s,
        "restored from orbax cache" if from_cache else "converted from the source",
    )  # fmt: skip
    return LoadedModel(module, params, arch, tokenizer, name, path, load_time, from_cache)


def _restore_or_none(cache: CheckpointCache, abstract: Any) -> Any:
    """The cache's params, or None when it does not restore (a truncated or overwritten file): the failure
    is logged with the cache's path and the caller converts from the source, which rewrites the cache."""
    try:
        return cache.restore(abstract)
    except Exception as e:  # noqa: BLE001 - whatever orbax or tensorstore raise on a damaged file
        logger.warning(
            "orbax cache %s is corrupt (%s: %s); converting from the source and writing it again",
            cache.directory,
            type(e).__name__,
            str(e)[:500],
        )
        return None


def _save_or_log(cache: CheckpointCache, params: Any, hf_config: dict, tokenizer: Any) -> None:
    """Write the converted params to the cache; a failure (a full disk, a read-only folder) is logged and
    the half-written cache left invalid (its meta file goes last), so this start serves from the converted
    params and the next one converts again."""
    start = time.perf_counter()
    try:
        cache.save(params, hf_config, tokenizer)
    except Exception as e:  # noqa: BLE001 - OSError, or orbax's wrapping of one
        logger.warning(
            "could not write the orbax cache %s (%s: %s); serving goes on, the next start converts again",
            cache.directory,
            type(e).__name__,
            str(e)[:500],
        )
        return
    logger.info("saved converted params to %s in %.2f s", cache.directory, time.perf_counter() - start)


def params_layout(tp_size: int, quantization: str | None = None, kind: str = "hf") -> str:
    """What a converted cache's tree depends on besides its source and dtype: the fused projections'
    layout, which differs with the tensor-parallel size (models/fused_projections.py), and the flag
    that may quantize a float checkpoint at load. A GGUF file's tree is set by its tensor types alone
    (the flag is None or "gguf"): its Q8_0/Q4_* projections are int8/int4 leaves, never the float
    kernels a cache of the dequantized file would hold."""
    layout = f"fused-qkv-gate-up/tp{tp_size}"
    if kind == "gguf":
        return f"{layout}/gguf-int4-int8"
    layout += "/w8a8-nk"  # a W8A8 qweight is [N, K] (quantization/scheme.py); caches of [K, N] ones don't fit
    return layout if quantization is None else f"{layout}/q-{quantization}"


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _load_tokenizer(spec: ModelSpec, kind: str, path: str, cache: CheckpointCache | None) -> Any:
    from jaxllm.tokenizer import load_tokenizer

    if spec.tokenizer is not None:
        return load_tokenizer(spec.tokenizer)
    if cache is not None:
        return load_tokenizer(cache.tokenizer_dir) if cache.has_tokenizer else None
    if kind == "dummy" and not os.path.isdir(path):
        return None
    try:
        return load_tokenizer(path)
    except ValueError as e:  # weights without tokenizer files: fine for token-id inputs
        logger.warning("no tokenizer loaded for %s: %s", path, e)
        return None


def _with_shardings(abstract: dict, sharding_fn: ShardingFn | None) -> dict:
    from flax import traverse_util

    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = traverse_util.flatten_dict(abstract)
    out = {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=sharding_fn("/".join(k), v) if sharding_fn else default
        )
        for k, v in flat.items()
    }
    return traverse_util.unflatten_dict(out)
