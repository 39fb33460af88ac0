"""A model's request sampling defaults (vLLM's `--generation-config`), read once at start-up.

    "auto":    HF folder     -> <folder>/generation_config.json
               GGUF file     -> its general.sampling.* keys, then a generation_config.json beside it on top
               embedded model -> its card's settings (jaxllm/embedded.py: the GGUF carries none)
               preset         -> none (random weights have no recommended sampling)
    "vllm":    none: SamplingParams' own defaults
    a folder:  <folder>/generation_config.json
  then --override-generation-config on top -> SamplingParams field names (config.sampling_defaults_from)

Model authors ship these (Llama 3: temperature 0.6, top_p 0.9) because the model answers best with them;
requests that leave a field out get the author's value, as vLLM does by default.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxllm.config import GenerationDefaults, sampling_defaults_from
from jaxllm.embedded import EMBEDDED_GENERATION_CONFIG, EMBEDDED_MODEL_NAME
from jaxllm.loader.loader import ModelSource

FILE_NAME = "generation_config.json"


def read_generation_defaults(
    mode: str, override: dict[str, Any] | None, source: ModelSource
) -> GenerationDefaults:
    """`mode`: EngineArgs.generation_config ("auto", "vllm" or a folder); `override`: its
    override_generation_config. Raises ValueError naming the file or flag for a value SamplingParams refuses."""
    where = "--generation-config"
    if mode == "vllm":
        config, origin = {}, "--generation-config vllm"
    elif mode == "auto":
        config, origin = _model_generation_config(source)
    else:
        path = os.path.join(mode, FILE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {mode!r}: the folder holds no {FILE_NAME}")
        config, origin, where = _read_json(path), path, path
    values = sampling_defaults_from(config, where)
    if override:
        values.update(sampling_defaults_from(override, "--override-generation-config"))
        origin += ", then --override-generation-config"
    return GenerationDefaults(values=values, source=origin)


def _model_generation_config(source: ModelSource) -> tuple[dict[str, Any], str]:
    if source.spec.model is None:
        return dict(EMBEDDED_GENERATION_CONFIG), f"the {EMBEDDED_MODEL_NAME} model card"
    if os.path.isdir(source.path):
        path = os.path.join(source.path, FILE_NAME)
        return (
            (_read_json(path), path)
            if os.path.isfile(path)
            else ({}, f"none ({source.path} has no {FILE_NAME})")
        )
    if source.kind == "gguf":
        config = dict(source.hf_config.get("gguf_generation_config") or {})
        origins = [f"{os.path.basename(source.path)} general.sampling.*"] if config else []
        beside = os.path.join(os.path.dirname(os.path.abspath(source.path)), FILE_NAME)
        if os.path.isfile(beside):
            config.update(_read_json(beside))
            origins.append(beside)
        name = os.path.basename(source.path)
        return config, " and ".join(
            origins
        ) or f"{name} has no general.sampling.* keys nor a {FILE_NAME} beside it"
    return {}, "a random-weight preset has no generation config"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config
