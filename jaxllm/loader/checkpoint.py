"""Orbax cache of converted params: convert once (safetensors/GGUF -> our tree and dtype), restore fast.

`save_params(path, params)` / `restore_params(path, abstract)` wrap orbax's StandardCheckpointer.
`CheckpointCache(dir, source, dtype)` adds the HF-style config, the tokenizer and a fingerprint of the source
(file names, sizes, mtimes), so a cache made from another model or dtype is never restored by mistake and a
valid one is restored without reading the source.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

_META = "jaxllm_meta.json"
_PARAMS = "params"
_TOKENIZER = "tokenizer"


def save_params(path: str, params: Any) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(path), params, force=True)
        ckpt.wait_until_finished()


def restore_params(path: str, abstract: Any) -> Any:
    """`abstract`: pytree of ShapeDtypeStruct (with `.sharding` set to place the restored arrays)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"orbax checkpoint {path} does not exist")
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, abstract)


def source_fingerprint(source: str) -> dict[str, Any]:
    if not os.path.exists(source):
        return {"source": source}
    files = (
        [source] if os.path.isfile(source) else sorted(os.path.join(source, f) for f in os.listdir(source))
    )
    return {
        "source": os.path.abspath(source),
        "files": [
            [os.path.basename(f), os.path.getsize(f), int(os.path.getmtime(f))]
            for f in files
            if os.path.isfile(f)
        ],
    }


class CheckpointCache:
    """`directory/params` (orbax), `directory/tokenizer/` (saved fast tokenizer), `directory/jaxllm_meta.json`
    (source fingerprint, requested dtype, platform, the HF-style config): a valid cache is restored without
    opening the source at all."""

    def __init__(self, directory: str, source: str, requested_dtype: str, layout: str = ""):
        """`layout`: how the params tree is laid out (its fused projections; loader.params_layout)."""
        self.directory = os.path.abspath(directory)
        self.key = {
            **source_fingerprint(source),
            "dtype": requested_dtype,
            "platform": jax.default_backend(),
            "layout": layout,
        }
        self._meta: dict[str, Any] | None = None

    @property
    def tokenizer_dir(self) -> str:
        return os.path.join(self.directory, _TOKENIZER)

    def valid(self) -> bool:
        meta_path = os.path.join(self.directory, _META)
        if not os.path.isfile(meta_path) or not os.path.isdir(os.path.join(self.directory, _PARAMS)):
            return False
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            return False
        if meta.get("key") != json.loads(json.dumps(self.key)):
            return False
        self._meta = meta
        return True

    @property
    def hf_config(self) -> dict[str, Any]:
        assert self._meta is not None, "call valid() first"
        return self._meta["hf_config"]

    def restore(self, abstract: Any) -> Any:
        return restore_params(os.path.join(self.directory, _PARAMS), abstract)

    def save(self, params: Any, hf_config: dict[str, Any], tokenizer: Any) -> None:
        os.makedirs(self.directory, exist_ok=True)
        meta_path = os.path.join(self.directory, _META)
        if os.path.exists(meta_path):
            os.remove(meta_path)  # the meta goes last, so a half-written cache is never trusted
        save_params(os.path.join(self.directory, _PARAMS), params)
        if jax.process_index() != 0:
            return
        if tokenizer is not None:
            tokenizer.save_pretrained(self.tokenizer_dir)
        with open(meta_path, "w") as f:
            json.dump({"key": self.key, "hf_config": hf_config, "has_tokenizer": tokenizer is not None}, f)

    @property
    def has_tokenizer(self) -> bool:
        return bool(self._meta and self._meta.get("has_tokenizer"))
