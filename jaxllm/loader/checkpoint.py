"""Orbax cache of converted params: convert once (safetensors/GGUF -> our tree and dtype), restore fast.

`save_params(path, params)` / `restore_params(path, abstract)` wrap orbax's StandardCheckpointer.
`CheckpointCache(dir)` adds a small `jaxllm_meta.json` (source, its size and mtime, dtype, architecture)
so a cache made from another model or dtype is never restored by mistake.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

_META = "jaxllm_meta.json"
_PARAMS = "params"


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
    def __init__(self, directory: str, source: str, dtype: str, architecture: str):
        self.directory = os.path.abspath(directory)
        self.meta = {**source_fingerprint(source), "dtype": dtype, "architecture": architecture}

    def valid(self) -> bool:
        meta_path = os.path.join(self.directory, _META)
        if not os.path.isfile(meta_path) or not os.path.isdir(os.path.join(self.directory, _PARAMS)):
            return False
        with open(meta_path) as f:
            return json.load(f) == json.loads(json.dumps(self.meta))

    def restore(self, abstract: Any) -> Any:
        return restore_params(os.path.join(self.directory, _PARAMS), abstract)

    def save(self, params: Any) -> None:
        os.makedirs(self.directory, exist_ok=True)
        meta_path = os.path.join(self.directory, _META)
        if os.path.exists(meta_path):
            os.remove(meta_path)  # the meta goes last, so a half-written cache is never trusted
        save_params(os.path.join(self.directory, _PARAMS), params)
        if jax.process_index() == 0:
            with open(meta_path, "w") as f:
                json.dump(self.meta, f)
