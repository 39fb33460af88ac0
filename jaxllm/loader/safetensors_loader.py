"""Hugging Face folder -> (ModelArchConfig, params): config.json plus one or many *.safetensors.

Each file is opened with `safe_open(framework="flax")` and read tensor by tensor: a tensor lands on the
device, is cast/transposed there and placed by ParamsBuilder; only one checkpoint tensor is alive at a
time besides the growing params tree, so the weights are never held twice. A quantized checkpoint's
linear modules go through QuantizedModules (held until each module is complete, then converted to the
canonical layout of jaxllm/quantization/scheme.py).
"""

from __future__ import annotations

import functools
import glob
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxllm.loader.names import hf_name_mapper
from jaxllm.loader.params_builder import ParamsBuilder, ShardingFn
from jaxllm.loader.quantized_modules import QuantizedModules
from jaxllm.models.config import ModelArchConfig
from jaxllm.quantization.checkpoint_formats import packing_for


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json; expected a Hugging Face model folder")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    # generation_config.json may name more end-of-turn tokens (Llama 3 instruct): stop on all of them
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
        except json.JSONDecodeError:
            gen_eos = None
        ids = []
        for eos in (config.get("eos_token_id"), gen_eos):
            for i in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
                if i not in ids:
                    ids.append(i)
        if ids:
            config["eos_token_id"] = ids
    return config


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is listed in {index} but missing")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weight files")
    return files


def load_safetensors_params(
    folder: str,
    arch: ModelArchConfig,
    abstract: dict,
    sharding_fn: ShardingFn | None = None,
    fused_groups: tuple = (),
) -> dict:
    builder = ParamsBuilder(abstract, folder, sharding_fn, fused_groups, arch.quant)
    mapper = hf_name_mapper(arch)
    packing = packing_for(arch.quant) if arch.quant is not None else None
    quantized = QuantizedModules(packing, builder, lambda n: mapper(n, arch), folder) if packing else None
    for path in safetensors_files(folder):
        try:
            handle = safe_open(path, framework="flax")
        except Exception as e:  # the library raises its own error types for truncated/corrupt headers
            raise ValueError(f"cannot read weight file {path}: {e}") from None
        with handle as f:
            for name in f.keys():
                if quantized is not None and quantized.claim(name, functools.partial(_read, f, name, path)):
                    continue
                mapped = mapper(name, arch)
                if mapped is None:
                    continue
                x = _read(f, name, path)
                builder.put(mapped[0], x, transpose=mapped[1], tensor_name=f"{os.path.basename(path)}:{name}")
                del x
    if quantized is not None:
        quantized.finish()
    return builder.finish()


def _read(f, name: str, path: str):
    try:
        raw = _raw_fp8(path, name)
        if raw is not None:
            return raw
        return f.get_tensor(name)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read tensor {name!r} from {path}: {e}") from None


_FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


@functools.lru_cache(maxsize=8)
def _header(path: str) -> tuple[dict, int]:
    """(the file's tensor table, where its data starts): safetensors' 8-byte length, then JSON."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n)), 8 + n


def _raw_fp8(path: str, name: str):
    """An FP8 tensor straight from the file's bytes, or None for other dtypes: the safetensors reader's
    flax and numpy paths have no float8 types (numpy has none), the ml_dtypes ones serve."""
    table, start = _header(path)
    entry = table.get(name)
    if entry is None or entry.get("dtype") not in _FP8:
        return None
    lo, hi = entry["data_offsets"]
    data = np.fromfile(path, dtype=np.uint8, count=hi - lo, offset=start + lo)
    return data.view(_FP8[entry["dtype"]]).reshape(entry["shape"])


def checkpoint_dtype(arch: ModelArchConfig) -> jnp.dtype:
    return jnp.dtype(arch.dtype if arch.dtype in ("bfloat16", "float16", "float32") else "float32")
