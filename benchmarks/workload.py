"""What the benchmarks send and where their results go.

    --input-len/--output-len/--range-ratio/--seed --random_requests--> [BenchRequest] (random token ids)
    --dataset file.jsonl --load_jsonl--> [BenchRequest] (text or token-id prompts, own output lengths)
    result dict --save_result--> benchmarks/results/<date>-<device>-<name>.json

Random requests follow vLLM's random dataset: each length is drawn uniformly from
[floor(len * (1 - r)), ceil(len * (1 + r))] (at least 1), and each prompt is that many token ids drawn
uniformly from [0, vocab_size). The same seed gives the same requests. A result file is one JSON object
with the keys in RESULT_KEYS (see `make_result`); summarize.py reads them back.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_KEYS = ("benchmark", "name", "date", "device", "model", "args", "results", "roofline")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids
    input_len: int  # tokens in the prompt (for text: as counted by the tokenizer, or 0 when unknown)
    output_len: int  # tokens to generate (sent with ignore_eos unless extra_body says otherwise)
    extra_body: dict[str, Any] | None = None  # more request fields, e.g. structured_outputs; they win

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len={self.output_len} must be >= 1")
        if self.input_len < 0:
            raise ValueError(f"input_len={self.input_len} must be >= 0")


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths for a mean length and a range ratio in [0, 1)."""
    if mean < 1:
        raise ValueError(f"length={mean} must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return low, high


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=int(i)).tolist(), int(i), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def load_jsonl(
    path: str, default_output_len: int, num_prompts: int | None = None, tokenizer=None
) -> list[BenchRequest]:
    """One request per line: {"prompt": text} or {"prompt_token_ids": [...]}, optionally "output_len"
    (or "max_tokens"). Text prompts are measured with `tokenizer` when given."""
    out: list[BenchRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            out_len = int(row.get("output_len", row.get("max_tokens", default_output_len)))
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
                out.append(BenchRequest(ids, len(ids), out_len))
            elif "prompt" in row:
                text = str(row["prompt"])
                n = len(tokenizer.encode(text)) if tokenizer is not None else 0
                out.append(BenchRequest(text, n, out_len))
            else:
                raise ValueError(f"{path}:{lineno}: a line needs 'prompt' or 'prompt_token_ids'")
            if num_prompts is not None and len(out) >= num_prompts:
                break
    if not out:
        raise ValueError(f"dataset {path} holds no requests")
    return out


def hf_config_for_model(model: str | None) -> dict[str, Any]:
    """HF-style config dict of a preset name, HF folder, GGUF file, or (None) the embedded model."""
    from jaxllm.models.presets import PRESETS, get_preset

    if model in PRESETS:
        return get_preset(model)
    if model is None or str(model).endswith(".gguf"):
        from jaxllm.embedded import embedded_model_path
        from jaxllm.loader.gguf_loader import gguf_hf_config, open_gguf

        path = model or embedded_model_path()
        return gguf_hf_config(open_gguf(path), path)
    from jaxllm.loader.safetensors_loader import read_hf_config

    return read_hf_config(model)


def arch_for_model(model: str | None):
    """ModelArchConfig of a model without loading its weights."""
    from jaxllm.models.config import ModelArchConfig

    return ModelArchConfig.from_hf(hf_config_for_model(model))


def device_tag() -> str:
    """'h200' (from nvidia-smi's GPU name) or 'cpu'; used in result file names."""
    name = gpu_name()
    if name is None:
        return "cpu"
    tag = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).split()[0].lower()
    return re.sub(r"[^a-z0-9]+", "", tag) or "gpu"


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def make_result(
    benchmark: str,
    name: str,
    model: str | None,
    args: dict[str, Any],
    results: dict[str, Any],
    roofline: dict[str, Any] | None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": gpu_name() or "cpu",
        "model": model or "embedded",
        "args": args,
        "results": results,
        "roofline": roofline,
        **extra,
    }


def result_path(name: str, results_dir: Path = RESULTS_DIR) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"
    return results_dir / f"{datetime.date.today().isoformat()}-{device_tag()}-{safe}.json"


def save_result(result: dict[str, Any], output_json: str | None = None) -> Path:
    path = Path(output_json) if output_json else result_path(result["name"])
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
