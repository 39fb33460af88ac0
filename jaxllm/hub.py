"""Hugging Face Hub model ids: `jaxllm serve ORG/NAME` and `LLM("ORG/NAME")` fetch the files jaxllm reads
with huggingface_hub, into its cache, and then load the snapshot folder as any local folder.

    ModelSpec(model="ORG/NAME", revision, download_dir)
      --resolve_hub_model--> ModelSpec(model=".../models--ORG--NAME/snapshots/<commit>", name="ORG/NAME")

Two downloads, so that only the weights the model uses arrive: first the small files (config,
generation config, tokenizer files, chat template, the safetensors index), then the weight files the
index names (or every top-level *.safetensors without an index). Repositories that also hold a
consolidated copy of the weights, or files in sub-folders (`original/`), would otherwise double the
download. A random-weight load (--load-format dummy) takes the small files only.

A path that exists always wins over a Hub id, and so do presets and .gguf paths (their errors stay the
loader's). The model keeps its id as its name (what /v1/models lists, as vLLM), not the snapshot folder's
commit hash. No jax here: the server catches ModelNotFoundError without importing the engine.

Environment, as huggingface_hub reads it: HF_TOKEN (gated and private models), HF_HOME / HF_HUB_CACHE
(the cache; --download-dir overrides), HF_ENDPOINT (a mirror). HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE)
fetches nothing: the cache must hold the files. HF_HUB_OFFLINE and HF_ENDPOINT are read here at each call,
because huggingface_hub reads them once, when it is first imported (by transformers, often before).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Collection

from jaxllm.config import ModelSpec

logger = logging.getLogger("jaxllm")

# Everything a model folder needs besides its weights; top-level files only (IGNORED_PATTERNS).
SMALL_FILE_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
WEIGHT_PATTERNS = ["*.safetensors"]
IGNORED_PATTERNS = ["*/*"]
INDEX_FILE = "model.safetensors.index.json"


class ModelNotFoundError(FileNotFoundError):
    """The model named cannot be had: no such path, or a Hub model id that is absent, gated, without that
    revision, or not cached when offline. The message names it and says what to do; `jaxllm serve` prints
    it as one line, not a traceback."""


def is_offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get(v, "").strip().upper() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(v in ("1", "ON", "YES", "TRUE") for v in env)


def is_hub_model_id(name: str | None, local_names: Collection[str] = ()) -> bool:
    """Whether `name` is to be fetched from the Hub: a valid repo id ("ORG/NAME" or "NAME") that is no
    existing path, .gguf path or one of `local_names` (the random-weight presets)."""
    if name is None or os.path.exists(name) or name in local_names or name.endswith(".gguf"):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_hub_model(spec: ModelSpec, local_names: Collection[str] = ()) -> ModelSpec:
    """`spec` with a Hub id in `model` (and in `tokenizer`) replaced by its snapshot folder, the files
    fetched or found in the cache; unchanged when neither is a Hub id. `local_names`: names that are never
    Hub ids (the loader's presets). Raises ModelNotFoundError naming the id."""
    model, tokenizer, name = spec.model, spec.tokenizer, spec.name
    if is_hub_model_id(spec.model, local_names):
        model = download_model(
            spec.model, spec.revision, spec.download_dir, weights=spec.load_format != "dummy"
        )
        name = name or spec.model
        if spec.tokenizer is None and spec.tokenizer_revision not in (None, spec.revision):
            tokenizer = download_model(spec.model, spec.tokenizer_revision, spec.download_dir, weights=False)
    if is_hub_model_id(spec.tokenizer, local_names):
        tokenizer = download_model(spec.tokenizer, spec.tokenizer_revision, spec.download_dir, weights=False)
    if (model, tokenizer, name) == (spec.model, spec.tokenizer, spec.name):
        return spec
    return dataclasses.replace(spec, model=model, tokenizer=tokenizer, name=name)


def download_model(model_id: str, revision: str | None, cache_dir: str | None, *, weights: bool) -> str:
    """The snapshot folder of `model_id` at `revision` (None: the default branch) holding the small files
    and, with `weights`, the safetensors weights."""
    from huggingface_hub import snapshot_download

    offline = is_offline()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, as HF_HUB_OFFLINE (see the docstring)

    def fetch(rev: str | None, patterns: list[str]) -> str:
        try:
            return snapshot_download(
                model_id,
                revision=rev,
                cache_dir=cache_dir,
                allow_patterns=patterns,
                ignore_patterns=IGNORED_PATTERNS,
                local_files_only=offline,
                endpoint=endpoint,
            )
        except Exception as e:  # huggingface_hub's errors, and OSError from the disk
            raise hub_error(model_id, revision, cache_dir, offline, e) from e

    folder = fetch(revision, SMALL_FILE_PATTERNS)
    if weights:
        # The snapshot folder is named by its commit: the weights come from the same commit even when the
        # branch moves between the two calls, and no second look-up of the branch is needed.
        fetch(os.path.basename(folder), weight_files(folder))
        if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
            raise ModelNotFoundError(
                f"model {model_id!r}{_at(revision)} has no safetensors weights ({folder}); jaxllm reads "
                "*.safetensors files, not PyTorch .bin files"
            )
    logger.info("model %s%s: %s", model_id, _at(revision), folder)
    return folder


def weight_files(folder: str) -> list[str]:
    """The weight files to fetch: those the safetensors index names, else every top-level *.safetensors."""
    index = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index):
        return WEIGHT_PATTERNS
    with open(index, encoding="utf-8") as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def hub_error(
    model_id: str, revision: str | None, cache_dir: str | None, offline: bool, e: Exception
) -> ModelNotFoundError:
    """One sentence naming the id and what to do, for each way huggingface_hub fails."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = _at(revision)
    if isinstance(e, GatedRepoError):
        why = (
            f"is gated on the Hugging Face Hub: accept its terms at https://huggingface.co/{model_id} "
            "and set HF_TOKEN to a token of that account"
        )
    elif isinstance(e, RepositoryNotFoundError):
        why = "is neither a local path nor a model on the Hugging Face Hub (a private model needs HF_TOKEN)"
    elif isinstance(e, RevisionNotFoundError):
        why, at = f"has no revision {revision!r} (--revision) on the Hugging Face Hub", ""
    elif isinstance(e, LocalEntryNotFoundError):
        cache = cache_dir or constants.HF_HUB_CACHE
        why = f"is not a local path and is not in the Hub cache {cache}{at}" + (
            " (HF_HUB_OFFLINE is set, so nothing is downloaded: unset it, or fetch the model into the "
            "cache first)"
            if offline
            else f", and the Hub could not be reached ({type(e.__cause__ or e).__name__})"
        )
        at = ""
    else:
        why = f"could not be fetched from the Hugging Face Hub: {type(e).__name__}: {e}"
    return ModelNotFoundError(f"model {model_id!r}{at} {why}".replace("\n", " "))


def _at(revision: str | None) -> str:
    return f" at revision {revision!r}" if revision is not None else ""
