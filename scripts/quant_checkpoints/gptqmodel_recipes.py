"""GPTQ and AWQ checkpoints made by GPTQModel on the CPU, group size 64 (128 divides neither 576 nor 1536).

GPTQ: `checkpoint_format` "gptq" (v1: qzeros hold zero - 1), qweight int32 [K/8, N], qzeros int32
[K/g, N/8], scales fp16 [K/g, N], g_idx int32 [K]; one symmetric with desc_act (act-order: g_idx is a
permutation of groups), one asymmetric without. AWQ: the GEMM layout (qweight int32 [K, N/8] in AWQ's
nibble order, qzeros, scales [K/g, N]) with zero points, from a float16 model as published AWQ
checkpoints are (AWQ runtimes compute in fp16). GPTQModel chooses a CUDA-only packer for AWQ GEMM
unless told otherwise; its torch backend (AWQ_TORCH) packs the same format on the CPU.

AutoAWQ itself is not used: it is deprecated (its last tested pairing is torch 2.6 / transformers 4.51),
and transformers 5 loads AWQ checkpoints through GPTQModel, whose AWQ is the maintained successor.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from base_model import set_torch_dtype

GROUP_SIZE = 64

# name -> (method, sym, desc_act, load dtype)
RECIPES = {
    "gptq-w4g64-sym-descact": ("gptq", True, True, torch.bfloat16),
    "gptq-w4g64-asym": ("gptq", False, False, torch.bfloat16),
    "awq-w4g64-gemm": ("awq", False, False, torch.float16),
}


def build_gptqmodel(name: str, base_dir: Path, out_dir: Path, texts: list[str]) -> dict:
    # GPTQModel sizes its CPU pool as (cores + 1) // 2 and then asks 2 workers of it for loading: with
    # fewer than 4 cores that fails ("requests 2 workers but parent 'cpu' only has 1").
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD

    method, sym, desc_act, dtype = RECIPES[name]
    if method == "awq":
        config = QuantizeConfig(
            bits=4,
            group_size=GROUP_SIZE,
            sym=sym,
            method=METHOD.AWQ,
            format=FORMAT.GEMM,
            offload_to_disk=False,
        )
        backend = BACKEND.AWQ_TORCH
    else:
        config = QuantizeConfig(
            bits=4,
            group_size=GROUP_SIZE,
            sym=sym,
            desc_act=desc_act,
            format=FORMAT.GPTQ,
            offload_to_disk=False,
        )
        backend = BACKEND.AUTO
    model = GPTQModel.load(str(base_dir), config, device="cpu", dtype=dtype)
    model.quantize(texts, batch_size=1, backend=backend)
    model.save(str(out_dir))
    dtype_name = str(dtype).removeprefix("torch.")
    set_torch_dtype(out_dir, dtype_name)
    return {"method": method, "sym": sym, "desc_act": desc_act, "group_size": GROUP_SIZE, "dtype": dtype_name}
