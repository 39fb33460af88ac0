"""What the benchmarks send and where their results go.

    --workload random: --input-len/--output-len/--range-ratio/--seed --random_requests--> [BenchRequest]
    --workload shared-prefix: --prefix-len + --input-len --shared_prefix_requests--> one system prompt
        shared by all, then a distinct user part each
    --workload chat: --input-len/--output-len as medians, --input-sigma/--output-sigma --chat_requests-->
        log-normal lengths
    --dataset file.jsonl --load_jsonl--> [BenchRequest] (text or token-id prompts, own output lengths)
    result dict --save_result--> benchmarks/results/<date>-<device>-<name>.json

Random requests follow vLLM's random dataset: each length is drawn uniformly from
[floor(len * (1 - r)), ceil(len * (1 + r))] (at least 1), and each prompt is that many token ids drawn
uniformly from [0, vocab_size). The same seed gives the same requests.

The shared-prefix workload is a chat service's system prompt: `prefix_len` ids (2,000 by default) that
every request starts with, then `input_len` ids of its own. Once the first request has filled the prefix
cache, each later one finds prefix_len / (prefix_len + input_len) of its prompt there (2,000 + 200: 91%);
`cached_prefix_lens` gives the most any prefix cache could supply, which the roofline leaves out of the
prefill it counts. The chat workload draws lengths like chat traffic without a dataset download: each
length is log-normal, ln(len) ~ Normal(ln(median), sigma^2), rounded and clipped to [1, CHAT_CLIP x median];
input sigma 1.0 and output sigma 0.8 by default (a long right tail: 10% of prompts are longer than 3.6x
the median), every prompt random ids as above. A result file is one JSON object
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
WORKLOADS = ("random", "shared-prefix", "chat")
CHAT_CLIP = 8  # chat lengths are clipped to this many times their median
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


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """`prefix_len` random ids shared by every request, then `input_len` random ids of each one's own."""
    if prefix_len < 1:
        raise ValueError(f"prefix_len={prefix_len} must be >= 1")
    if input_len < 1:
        raise ValueError(f"input_len={input_len} must be >= 1 (the distinct part after the shared prefix)")
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    return [
        BenchRequest(
            prefix + rng.integers(0, vocab_size, size=input_len).tolist(), prefix_len + input_len, output_len
        )
        for _ in range(num_prompts)
    ]


def lognormal_lengths(rng: np.random.Generator, n: int, median: int, sigma: float, name: str) -> np.ndarray:
    """n lengths with ln(len) ~ Normal(ln(median), sigma^2), rounded, clipped to [1, CHAT_CLIP x median]."""
    if median < 1:
        raise ValueError(f"{name}={median} (the median length) must be >= 1")
    if sigma < 0:
        raise ValueError(f"{name.replace('len', 'sigma')}={sigma} must be >= 0")
    x = np.exp(rng.normal(math.log(median), sigma, size=n))  # f64[n]
    return np.clip(np.rint(x), 1, CHAT_CLIP * median).astype(np.int64)


def chat_requests(
    num_prompts: int,
    input_median: int,
    output_median: int,
    vocab_size: int,
    input_sigma: float = 1.0,
    output_sigma: float = 0.8,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random-id prompts whose input and output lengths are log-normal around the given medians."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = np.random.default_rng(seed)
    in_lens = lognormal_lengths(rng, num_prompts, input_median, input_sigma, "input_len")
    out_lens = lognormal_lengths(rng, num_prompts, output_median, output_sigma, "output_len")
    return [
        BenchRequest(rng.integers(0, vocab_size, size=int(i)).tolist(), int(i), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))  # i64[mismatches]
    return int(diff[0]) if diff.size else n


def cached_prefix_lens(prompts: list[list[int]], primers: list[list[int]] = ()) -> list[int]:
    """Per prompt, the most of it a prefix cache could supply (in the same order), when `primers` were
    served before and every prefix is computed once: the longest prefix it shares with a primer or with
    a prompt before it in sorted order (sorted, that is its predecessor). At least its last token is
    computed (its logits)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    out = [0] * len(prompts)
    for k, cur in enumerate(order):
        p = prompts[cur]
        shared = [common_prefix(p, q) for q in primers]
        if k > 0:
            shared.append(common_prefix(prompts[order[k - 1]], p))
        out[cur] = min(max(shared, default=0), len(p) - 1)
    return out


def add_workload_args(p) -> None:
    """The --workload flags that throughput.py and serve.py share (beside their --input-len/--output-len)."""
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: --input-len/--output-len (+ --range-ratio); shared-prefix: a --prefix-len system prompt "
        "shared by all, then --input-len ids each; chat: log-normal lengths with medians --input-len/--output-len",
    )
    p.add_argument(
        "--prefix-len", type=int, default=2000, help="shared-prefix: the shared system prompt's ids"
    )
    p.add_argument("--input-sigma", type=float, default=1.0, help="chat: sigma of ln(input length)")
    p.add_argument("--output-sigma", type=float, default=0.8, help="chat: sigma of ln(output length)")


def workload_requests(args, num_prompts: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The requests of `args.workload` (flags of add_workload_args and the benchmark's length flags)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    if args.workload == "shared-prefix":
        return shared_prefix_requests(
            num_prompts, args.prefix_len, args.input_len, args.output_len, vocab_size, seed
        )
    if args.workload == "chat":
        return chat_requests(
            num_prompts,
            args.input_len,
            args.output_len,
            vocab_size,
            args.input_sigma,
            args.output_sigma,
            seed,
        )
    return random_requests(num_prompts, args.input_len, args.output_len, vocab_size, args.range_ratio, seed)


def workload_label(args) -> str:
    """The workload in a few words, for names and reports."""
    if args.workload == "shared-prefix":
        return f"shared-prefix {args.prefix_len}+{args.input_len}->{args.output_len}"
    if args.workload == "chat":
        return (
            f"chat lognormal in median {args.input_len} sigma {args.input_sigma}, out median "
            f"{args.output_len} sigma {args.output_sigma}"
        )
    return f"random {args.input_len}->{args.output_len}" + (
        f" +/-{args.range_ratio:.0%}" if args.range_ratio else ""
    )


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


def device_tag(name: str | None = None) -> str:
    """'h100', 'h200' (from a device name, default nvidia-smi's) or 'cpu'; used in result file names."""
    name = name if name is not None else gpu_name()
    if name is None or name.strip().lower() == "cpu":
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
    device: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """`device`: the card the figures are from (a benchmark that runs JAX passes its device kind; else
    nvidia-smi's name, else 'cpu')."""
    return {
        "benchmark": benchmark,
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device or gpu_name() or "cpu",
        "model": model or "embedded",
        "args": args,
        "results": results,
        "roofline": roofline,
        **extra,
    }


def result_path(name: str, results_dir: Path = RESULTS_DIR, device: str | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"
    return results_dir / f"{datetime.date.today().isoformat()}-{device_tag(device)}-{safe}.json"


def save_result(result: dict[str, Any], output_json: str | None = None) -> Path:
    path = Path(output_json) if output_json else result_path(result["name"], device=result.get("device"))
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
