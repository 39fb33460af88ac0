"""Weight loading: HF safetensors folders, GGUF files, random presets, and an orbax cache of the result."""

from jaxllm.loader.checkpoint import restore_params, save_params
from jaxllm.loader.loader import (
    LoadedModel,
    ModelSource,
    load_model,
    load_weights,
    open_model,
    resolve_dtype,
    resolve_model,
)

__all__ = [
    "LoadedModel",
    "ModelSource",
    "load_model",
    "load_weights",
    "open_model",
    "resolve_dtype",
    "resolve_model",
    "restore_params",
    "save_params",
]
