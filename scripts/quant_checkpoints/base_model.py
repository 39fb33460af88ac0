"""The "base" checkpoint every quantized one is made from: the embedded GGUF (SmolLM2-135M-Instruct, Q4_1)
dequantized by transformers' GGUF reader and saved as a bfloat16 safetensors folder with its tokenizer.

transformers marks a GGUF-loaded model as quantized (method "gguf") and refuses to save it, so the weights
are moved into a fresh model built from the same config without that mark. bfloat16 is the dtype the
quantization tools start from in practice and what jaxllm serves; the Q4_1 values are not all exact in
bfloat16, so this checkpoint, not the GGUF, is the reference the quantized ones drift from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def build_base(gguf_path: str, out_dir: Path) -> dict:
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    set_torch_dtype(out_dir, "bfloat16")
    return {"source": os.path.basename(gguf_path), "dtype": "bfloat16"}


def set_torch_dtype(folder: Path, dtype: str) -> None:
    """transformers 5 writes `dtype`; readers written for 4.x (and jaxllm's loader first) read `torch_dtype`.
    Both are written so either kind of reader sees the checkpoint's dtype."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
