"""config.json's `quantization_config` and `--quantization` -> the model's `QuantScheme` (or None).

As in vLLM, the method is detected from the checkpoint (the flag is then optional); a flag that names a
different method than the checkpoint's is an error, and `--quantization fp8` on a float checkpoint
quantizes it at load. Every layout jaxllm cannot serve is refused with the method and the field that
says so — a checkpoint is never served as something it is not.

  quant_method "awq"                 version gemm, 4 bits, zero_point -> int4 W4A16 (AWQ packing)
  quant_method "gptq"                4 bits, group_size, desc_act, sym, checkpoint_format gptq|gptq_v2
                                     -> int4 W4A16 (GPTQ packing)
  quant_method "compressed-tensors"  one config group of Linear layers, ignore = lm_head:
                                       float 8 weights (+ float 8 inputs)      -> fp8 W8A8 (or W8A16)
                                       int 8 weights (+ int 8 inputs)          -> int8 W8A8 (or W8A16)
                                       int 4 or weight-only int 8, pack-quantized -> int4/int8 W4A16/W8A16
  quant_method "fp8"                 per-tensor weight scales, activation_scheme dynamic|static -> fp8 W8A8
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxllm.quantization.scheme import QuantScheme, online_fp8

# --quantization values that name a checkpoint method, and the checkpoint method each accepts (vLLM's
# *_marlin names select a kernel of the same format: here the same path)
FLAG_METHODS = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
    "fp8": "fp8",
}
# the method each flag means for random weights (--load-format dummy), which have no config to read
DUMMY_SCHEMES = {
    "fp8": online_fp8(),
    "awq": QuantScheme("awq", "int4", group_size=128),
    "gptq": QuantScheme("gptq", "int4", group_size=128),
    "compressed-tensors": QuantScheme("compressed-tensors", "int4", group_size=128),
}


CT = "compressed-tensors"


class QuantConfigError(ValueError):
    pass


def _dummy_scheme(scheme: QuantScheme, hf_config: dict) -> QuantScheme:
    """The method's usual group size (128), or the largest power of two below it that divides every
    projection's inputs of a small model."""
    if scheme.group_size is None:
        return scheme
    heads = hf_config.get("num_attention_heads", 1)
    head_dim = hf_config.get("head_dim") or hf_config.get("hidden_size", 0) // heads
    widths = [hf_config.get("hidden_size", 0), hf_config.get("intermediate_size", 0), heads * head_dim]
    g = scheme.group_size
    while g > 2 and any(w % g for w in widths if w):
        g //= 2
    return dataclasses.replace(scheme, group_size=g)


def quant_scheme(hf_config: dict, flag: str | None, where: str, dummy: bool = False) -> QuantScheme | None:
    """The scheme of the model described by `hf_config` (config.json) under `--quantization flag`;
    `where` names the checkpoint in errors; `dummy`: random weights, shaped by the flag's method."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if flag == "gguf":
        return None  # a GGUF file's own types decide (jaxllm/loader/gguf_loader.py)
    if qc is None:
        if flag is None:
            return None
        method = FLAG_METHODS[flag]
        if method == "fp8":
            return online_fp8()
        if dummy:
            return _dummy_scheme(DUMMY_SCHEMES[method], hf_config)
        raise QuantConfigError(
            f"quantization={flag!r} (--quantization) needs a checkpoint quantized with {method}, but "
            f"{where}/config.json has no quantization_config; only fp8 quantizes a float checkpoint at load"
        )
    if not isinstance(qc, dict) or "quant_method" not in qc:
        raise QuantConfigError(f"{where}/config.json: quantization_config has no quant_method")
    method = str(qc["quant_method"])
    parse = _PARSERS.get(method)
    if parse is None:
        raise QuantConfigError(
            f"{where}/config.json: quantization_config.quant_method={method!r} is not supported; "
            f"supported: {', '.join(_PARSERS)}"
        )
    if flag is not None and FLAG_METHODS[flag] != method:
        raise QuantConfigError(
            f"quantization={flag!r} (--quantization) does not match the checkpoint's "
            f"quantization_config.quant_method={method!r} in {where}/config.json; leave the flag out or "
            f"give {method!r}"
        )
    return parse(qc, f"{where}/config.json: quantization_config")


def checkpoint_kv_cache_scales(hf_config: dict, where: str) -> bool:
    """Whether the checkpoint holds per-layer FP8 KV-cache scales (compressed-tensors kv_cache_scheme:
    float 8 bits, one scale per tensor), which an fp8 KV cache then uses instead of 1.0."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config") or {}
    kv = qc.get("kv_cache_scheme") if isinstance(qc, dict) else None
    if not kv:
        return False
    w = f"{where}/config.json: quantization_config.kv_cache_scheme"
    if (kv.get("type"), kv.get("num_bits")) != ("float", 8):
        raise _bad(w, "type", kv.get("type"), "an FP8 KV cache (float, 8 bits) is served")
    if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic"):
        raise _bad(w, "strategy", kv.get("strategy"), "static per-tensor KV scales are served")
    return True


def _bad(where: str, field: str, value: Any, why: str) -> QuantConfigError:
    return QuantConfigError(f"{where}.{field}={value!r}: {why}")


def _group(value: Any, where: str, field: str) -> int | None:
    if value in (None, -1, 0):
        return None
    g = int(value)
    if g < 2 or g % 2:
        raise _bad(where, field, value, "jaxllm serves even group sizes >= 2, or -1 (per channel)")
    return g


def _awq(qc: dict, where: str) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _bad(where, "bits", bits, "AWQ is served with 4-bit weights only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _bad(
            where, "version", version, "only AWQ's GEMM packing is served (gemv/marlin/exllama are not)"
        )
    if not qc.get("zero_point", True):
        raise _bad(where, "zero_point", False, "AWQ without zero points is not served")
    if qc.get("modules_to_not_convert"):
        raise _bad(
            where, "modules_to_not_convert", qc["modules_to_not_convert"],
            "layers left in float inside the decoder are not served",
        )  # fmt: skip
    g = _group(qc.get("group_size", qc.get("q_group_size")), where, "group_size")
    return QuantScheme("awq", "int4", group_size=g, packing="awq")


def _gptq(qc: dict, where: str) -> QuantScheme:
    if qc.get("bits") != 4:
        raise _bad(where, "bits", qc.get("bits"), "GPTQ is served with 4-bit weights only")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _bad(where, "checkpoint_format", fmt, "only the gptq and gptq_v2 packings are served")
    if qc.get("modules_in_block_to_quantize") or qc.get("dynamic"):
        raise _bad(
            where, "dynamic" if qc.get("dynamic") else "modules_in_block_to_quantize",
            qc.get("dynamic") or qc.get("modules_in_block_to_quantize"),
            "per-layer GPTQ settings are not served",
        )  # fmt: skip
    g = _group(qc.get("group_size"), where, "group_size")
    act_order = bool(qc.get("desc_act", False))
    sym = bool(qc.get("sym", True))
    return QuantScheme("gptq", "int4", group_size=g, act_order=act_order, packing=fmt, symmetric=sym)


def _fp8(qc: dict, where: str) -> QuantScheme:
    if qc.get("weight_block_size"):
        raise _bad(
            where, "weight_block_size", qc["weight_block_size"],
            "block-wise FP8 scales are not served; per-tensor FP8 checkpoints are",
        )  # fmt: skip
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _bad(where, "activation_scheme", scheme, "must be dynamic or static")
    if qc.get("ignored_layers") or qc.get("modules_to_not_convert"):
        field = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
        raise _bad(where, field, qc[field], "layers left in float inside the decoder are not served")
    return QuantScheme("fp8", "fp8", "fp8", static_input_scale=scheme == "static", packing="fp8")


def _ignored_ok(ignore: list) -> bool:
    return all(str(name).removeprefix("re:").lstrip(".*") in ("lm_head", "lm_head$") for name in ignore)


def _compressed_tensors(qc: dict, where: str) -> QuantScheme | None:
    groups = qc.get("config_groups") or {}
    if not groups and qc.get("kv_cache_scheme"):
        return None  # only the KV cache is quantized (checkpoint_kv_cache_scales); the weights are float
    if len(groups) != 1:
        raise _bad(where, "config_groups", sorted(groups), "exactly one group of Linear layers is served")
    ((gname, group),) = groups.items()
    gwhere = f"{where}.config_groups.{gname}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _bad(gwhere, "targets", targets, 'only ["Linear"] (every linear layer) is served')
    ignore = qc.get("ignore") or []
    if not _ignored_ok(ignore):
        raise _bad(where, "ignore", ignore, "only lm_head may stay unquantized")
    fmt = group.get("format") or qc.get("format")
    w, a = group.get("weights") or {}, group.get("input_activations")
    wtype, bits = w.get("type"), w.get("num_bits")
    kind = {("float", 8): "fp8", ("int", 8): "int8", ("int", 4): "int4"}.get((wtype, bits))
    if kind is None:
        raise _bad(gwhere, "weights", {"type": wtype, "num_bits": bits}, "served: float 8, int 8, int 4")
    if w.get("dynamic"):
        raise _bad(gwhere, "weights.dynamic", True, "weights must be quantized ahead")
    # llm-compressor writes W8A16 int8 as pack-quantized too (four codes per int32); W8A8 as int-quantized
    formats = {
        "fp8": ("float-quantized", "naive-quantized"),
        "int8": ("int-quantized", "naive-quantized", "pack-quantized"),
        "int4": ("pack-quantized",),
    }[kind]
    if fmt not in formats or (kind == "int8" and fmt == "pack-quantized" and a is not None):
        raise _bad(
            where, "format", fmt,
            f"{wtype} {bits}-bit weights are served in the {' or '.join(formats)} format"
            + (" (pack-quantized: weight-only)" if kind == "int8" else ""),
        )  # fmt: skip
    packing = "pack-quantized" if fmt == "pack-quantized" else CT
    strategy = w.get("strategy")
    symmetric = w.get("symmetric", True)
    if kind != "int4" and not symmetric:
        raise _bad(gwhere, "weights.symmetric", False, "8-bit weights are served symmetric only")
    if strategy not in ("channel", "group", "tensor"):
        raise _bad(gwhere, "weights.strategy", strategy, "served: channel, group, tensor")
    g = _group(w.get("group_size"), gwhere, "weights.group_size") if strategy == "group" else None
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "weight", "group", "static", "dynamic"):
        raise _bad(gwhere, "weights.actorder", actorder, "served: null, weight, group")
    # group (alias dynamic; true in older configs) keeps the g_idx of each input row; weight (alias static)
    # reorders only while quantizing, so the saved rows are in group order already
    act_order = actorder is True or actorder in ("group", "dynamic")
    if a is None:
        if kind == "int4":
            return QuantScheme(
                CT, "int4", group_size=g, act_order=act_order, packing=packing, symmetric=bool(symmetric)
            )
        return QuantScheme(CT, kind, group_size=g, packing=packing)
    akind = {("float", 8): "fp8", ("int", 8): "int8"}.get((a.get("type"), a.get("num_bits")))
    if akind != kind:
        raise _bad(
            gwhere, "input_activations", {"type": a.get("type"), "num_bits": a.get("num_bits")},
            f"served with {wtype} {bits}-bit weights: none, or the same type",
        )  # fmt: skip
    if g is not None:
        raise _bad(
            gwhere, "weights.strategy", strategy, "W8A8 is served with channel or tensor weight scales"
        )
    if not a.get("symmetric", True):
        raise _bad(gwhere, "input_activations.symmetric", False, "activations are quantized symmetric only")
    dynamic, astrategy = bool(a.get("dynamic")), a.get("strategy")
    if not ((dynamic and astrategy == "token") or (not dynamic and astrategy == "tensor")):
        raise _bad(
            gwhere, "input_activations", {"dynamic": dynamic, "strategy": astrategy},
            "served: dynamic per token, or static per tensor",
        )  # fmt: skip
    return QuantScheme(CT, kind, kind, static_input_scale=not dynamic, packing=CT)


_PARSERS = {
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
}
