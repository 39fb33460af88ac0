"""Read a model's architecture before loading it, so the sharding rules and checks exist first.

ModelSpec -> the same source resolution as the loader -> HF config dict -> ModelArchConfig. Reads only
config files (or GGUF metadata); weights are not touched.
"""

from __future__ import annotations

import os

from jaxllm.config import ModelSpec
from jaxllm.models.config import ModelArchConfig


def peek_arch(spec: ModelSpec) -> ModelArchConfig:
    from jaxllm.loader.gguf_loader import gguf_hf_config, open_gguf
    from jaxllm.loader.loader import source_kind
    from jaxllm.loader.safetensors_loader import read_hf_config
    from jaxllm.models.presets import get_preset

    kind, path = source_kind(spec)
    if kind == "gguf":
        hf_config = gguf_hf_config(open_gguf(path), path)
    elif os.path.isdir(path):
        hf_config = read_hf_config(path)
    else:
        hf_config = get_preset(path)
    return ModelArchConfig.from_hf(hf_config)
