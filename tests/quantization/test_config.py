"""config.json's quantization_config (and --quantization) -> QuantScheme, for configs shaped like the ones
AutoAWQ, AutoGPTQ/GPTQModel, llm-compressor (compressed-tensors) and the HF/vLLM fp8 format write, and
every refusal naming the field that causes it."""

from __future__ import annotations

import copy

import pytest

from jaxllm.quantization.config import QuantConfigError, quant_scheme
from jaxllm.quantization.scheme import QuantScheme, online_fp8

CT = "compressed-tensors"

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}  # fmt: skip


def gptq(desc_act: bool, sym: bool, fmt: str) -> dict:
    return {
        "bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": False,
        "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
        "quant_method": "gptq", "checkpoint_format": fmt,
    }  # fmt: skip


def qargs(num_bits: int, type_: str, strategy: str, *, dynamic=False, symmetric=True, group_size=None,
          actorder=None, observer="minmax") -> dict:  # fmt: skip
    """compressed-tensors' QuantizationArgs as model_dump() writes them into config.json."""
    return {
        "num_bits": num_bits, "type": type_, "symmetric": symmetric, "group_size": group_size,
        "strategy": strategy, "block_structure": None, "dynamic": dynamic, "actorder": actorder,
        "observer": observer, "observer_kwargs": {},
    }  # fmt: skip


def ct(weights: dict, inputs: dict | None, fmt: str) -> dict:
    return {
        "config_groups": {
            "group_0": {
                "input_activations": inputs, "output_activations": None, "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": fmt, "global_compression_ratio": 1.5, "ignore": ["lm_head"], "kv_cache_scheme": None,
        "quant_method": CT, "quantization_status": "compressed", "sparsity_config": {},
    }  # fmt: skip


TOKEN_FP8 = qargs(8, "float", "token", dynamic=True, observer=None)
TOKEN_INT8 = qargs(8, "int", "token", dynamic=True, observer=None)
CT_CONFIGS = {
    "FP8_DYNAMIC": (
        ct(qargs(8, "float", "channel"), TOKEN_FP8, "float-quantized"),
        QuantScheme(CT, "fp8", "fp8", packing=CT),
    ),
    "FP8 static": (
        ct(qargs(8, "float", "tensor"), qargs(8, "float", "tensor"), "float-quantized"),
        QuantScheme(CT, "fp8", "fp8", static_input_scale=True, packing=CT),
    ),
    "W8A8 int8": (
        ct(qargs(8, "int", "channel"), TOKEN_INT8, "int-quantized"),
        QuantScheme(CT, "int8", "int8", packing=CT),
    ),
    "W8A16 int8": (
        ct(qargs(8, "int", "channel"), None, "pack-quantized"),
        QuantScheme(CT, "int8", packing="pack-quantized"),
    ),
    "W8A16 fp8": (
        ct(qargs(8, "float", "channel"), None, "naive-quantized"),
        QuantScheme(CT, "fp8", packing=CT),
    ),
    "W4A16": (
        ct(qargs(4, "int", "group", group_size=128), None, "pack-quantized"),
        QuantScheme(CT, "int4", group_size=128, packing="pack-quantized"),
    ),
    "W4A16_ASYM actorder group": (
        ct(
            qargs(4, "int", "group", group_size=128, symmetric=False, actorder="group"),
            None,
            "pack-quantized",
        ),
        QuantScheme(CT, "int4", group_size=128, act_order=True, packing="pack-quantized", symmetric=False),
    ),
    "W4A16 actorder weight": (
        ct(qargs(4, "int", "group", group_size=128, actorder="weight"), None, "pack-quantized"),
        QuantScheme(CT, "int4", group_size=128, packing="pack-quantized"),
    ),
    "W4A16 channel": (
        ct(qargs(4, "int", "channel"), None, "pack-quantized"),
        QuantScheme(CT, "int4", packing="pack-quantized"),
    ),
}


def scheme_of(qc: dict, flag: str | None = None) -> QuantScheme | None:
    return quant_scheme({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}, flag, "/m")


def test_awq():
    assert scheme_of(AWQ) == QuantScheme("awq", "int4", group_size=128, packing="awq")
    assert scheme_of({**AWQ, "version": "GEMM"}).packing == "awq"


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [True, False])
def test_gptq(desc_act, sym, fmt):
    want = QuantScheme("gptq", "int4", group_size=128, act_order=desc_act, packing=fmt, symmetric=sym)
    assert scheme_of(gptq(desc_act, sym, fmt)) == want


def test_gptq_per_channel():
    assert scheme_of({**gptq(False, True, "gptq"), "group_size": -1}).group_size is None


@pytest.mark.parametrize("name", sorted(CT_CONFIGS))
def test_compressed_tensors(name):
    qc, want = CT_CONFIGS[name]
    assert scheme_of(qc) == want
    # older checkpoints name the section compression_config
    assert quant_scheme({"compression_config": qc}, None, "/m") == want


@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_fp8_format(activation_scheme):
    qc = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    static = activation_scheme == "static"
    assert scheme_of(qc) == QuantScheme("fp8", "fp8", "fp8", static_input_scale=static, packing="fp8")


def test_flags():
    assert quant_scheme({}, None, "/m") is None
    assert quant_scheme({}, "fp8", "/m") == online_fp8()
    assert online_fp8().online and online_fp8().packing is None
    assert scheme_of(AWQ, "awq_marlin") == scheme_of(AWQ)
    assert scheme_of(gptq(True, True, "gptq"), "gptq_marlin") == scheme_of(gptq(True, True, "gptq"))
    assert quant_scheme({}, "gguf", "/m") is None
    assert quant_scheme({}, "awq", "/m", dummy=True).weights == "int4"


@pytest.mark.parametrize(
    ("qc", "flag"),
    [(AWQ, "gptq"), (gptq(False, True, "gptq"), "awq"), (CT_CONFIGS["FP8_DYNAMIC"][0], "fp8"),
     ({"quant_method": "fp8"}, "compressed-tensors")],
)  # fmt: skip
def test_flag_that_names_another_method(qc, flag):
    with pytest.raises(
        QuantConfigError, match=rf"quantization={flag!r} .*quant_method={qc['quant_method']!r}"
    ):
        scheme_of(qc, flag)


@pytest.mark.parametrize("flag", ["awq", "gptq", "compressed-tensors"])
def test_flag_without_config(flag):
    with pytest.raises(QuantConfigError, match=r"/m/config.json has no quantization_config"):
        quant_scheme({}, flag, "/m")


def edit(qc: dict, path: str, value) -> dict:
    """A copy of qc with the dotted `path` set (or removed when value is ...)."""
    qc = copy.deepcopy(qc)
    *parents, last = path.split(".")
    node = qc
    for p in parents:
        node = node[p]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return qc


W4 = CT_CONFIGS["W4A16"][0]
W8A8 = CT_CONFIGS["W8A8 int8"][0]
FP8D = CT_CONFIGS["FP8_DYNAMIC"][0]
G = "config_groups.group_0"
GR = r"config_groups\.group_0"
REFUSALS = {
    "awq bits 3": (edit(AWQ, "bits", 3), r"quantization_config\.bits=3"),
    "awq gemv": (edit(AWQ, "version", "gemv"), r"quantization_config\.version='gemv'"),
    "awq no zero point": (edit(AWQ, "zero_point", False), r"quantization_config\.zero_point=False"),
    "awq float modules": (
        edit(AWQ, "modules_to_not_convert", ["mlp.gate"]),
        r"quantization_config\.modules_to_not_convert",
    ),
    "awq odd group": (edit(AWQ, "group_size", 3), r"quantization_config\.group_size=3"),
    "gptq bits 3": (edit(gptq(True, True, "gptq"), "bits", 3), r"quantization_config\.bits=3"),
    "gptq bits 8": (edit(gptq(True, True, "gptq"), "bits", 8), r"quantization_config\.bits=8"),
    "gptq marlin format": (
        edit(gptq(False, True, "gptq"), "checkpoint_format", "marlin"),
        r"quantization_config\.checkpoint_format",
    ),
    "gptq dynamic": (
        edit(gptq(False, True, "gptq"), "dynamic", {"-:.*down": {}}),
        r"quantization_config\.dynamic",
    ),
    "fp8 block-wise": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        r"quantization_config\.weight_block_size=\[128, 128\]",
    ),
    "fp8 bad activation scheme": (
        {"quant_method": "fp8", "activation_scheme": "token"},
        r"quantization_config\.activation_scheme='token'",
    ),
    "fp8 ignored layers": (
        {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
        r"quantization_config\.ignored_layers",
    ),
    "unknown method": ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method='bitsandbytes'"),
    "no method": ({"bits": 4}, r"quantization_config has no quant_method"),
    "ct two groups": (
        edit(W4, "config_groups.group_1", W4["config_groups"]["group_0"]),
        r"quantization_config\.config_groups=",
    ),
    "ct targets": (edit(W4, f"{G}.targets", ["re:.*q_proj"]), rf"quantization_config\.{GR}\.targets="),
    "ct ignore": (edit(W4, "ignore", ["lm_head", "re:.*down_proj"]), r"quantization_config\.ignore="),
    "ct int2": (edit(W4, f"{G}.weights.num_bits", 2), rf"quantization_config\.{GR}\.weights="),
    "ct nvfp4": (edit(W4, f"{G}.weights.type", "float"), rf"quantization_config\.{GR}\.weights="),
    "ct block strategy": (
        edit(FP8D, f"{G}.weights.strategy", "block"),
        rf"quantization_config\.{GR}\.weights\.strategy='block'",
    ),
    "ct dynamic weights": (
        edit(W4, f"{G}.weights.dynamic", True),
        rf"quantization_config\.{GR}\.weights\.dynamic=True",
    ),
    "ct int4 not packed": (
        edit(W4, "format", "int-quantized"),
        r"quantization_config\.format='int-quantized'",
    ),
    "ct marlin-24": (edit(W4, "format", "marlin-24"), r"quantization_config\.format='marlin-24'"),
    "ct W8A8 packed": (
        edit(W8A8, "format", "pack-quantized"),
        r"quantization_config\.format='pack-quantized'",
    ),
    "ct asym int8": (
        edit(W8A8, f"{G}.weights.symmetric", False),
        rf"quantization_config\.{GR}\.weights\.symmetric=False",
    ),
    "ct W4A8": (
        edit(W4, f"{G}.input_activations", TOKEN_INT8),
        rf"quantization_config\.{GR}\.input_activations=",
    ),
    "ct W8A8 group scales": (
        edit(edit(W8A8, f"{G}.weights.strategy", "group"), f"{G}.weights.group_size", 128),
        rf"quantization_config\.{GR}\.weights\.strategy='group'",
    ),
    "ct asym activations": (
        edit(W8A8, f"{G}.input_activations.symmetric", False),
        rf"quantization_config\.{GR}\.input_activations\.symmetric=False",
    ),
    "ct static per-token": (
        edit(W8A8, f"{G}.input_activations.dynamic", False),
        rf"quantization_config\.{GR}\.input_activations=",
    ),
    "ct actorder unknown": (
        edit(W4, f"{G}.weights.actorder", "random"),
        rf"quantization_config\.{GR}\.weights\.actorder='random'",
    ),
    "ct odd group": (
        edit(W4, f"{G}.weights.group_size", 7),
        rf"quantization_config\.{GR}\.weights\.group_size=7",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_the_field(name):
    qc, field = REFUSALS[name]
    with pytest.raises(QuantConfigError, match=rf"/m/config.json: {field}"):
        scheme_of(qc)


def test_scheme_checks_its_fields():
    with pytest.raises(ValueError, match="weights='int3'"):
        QuantScheme("x", "int3")
    with pytest.raises(ValueError, match="activations='fp8' needs 8-bit weights"):
        QuantScheme("x", "int4", "fp8")
    with pytest.raises(ValueError, match="group_size=5"):
        QuantScheme("x", "int4", group_size=5)
    with pytest.raises(ValueError, match="group_size=64 does not divide .* 96 input features"):
        QuantScheme("x", "int4", group_size=64).param_shapes(96, 8, "float32")


def test_param_shapes_follow_the_canonical_layout():
    k, n = 256, 64
    shapes = QuantScheme("gptq", "int4", group_size=32, act_order=True).param_shapes(k, n, "bfloat16")
    assert {name: s for name, (s, _) in shapes.items()} == {
        "qweight": (128, 64), "scales": (8, 64), "zeros": (8, 64), "perm": (256,)
    }  # fmt: skip
    shapes = QuantScheme("fp8", "fp8", "fp8", static_input_scale=True).param_shapes(k, n, "bfloat16")
    assert {name: s for name, (s, _) in shapes.items()} == {
        "qweight": (64, 256), "weight_scale": (64,), "input_scale": ()  # W8A8: [N, K]
    }  # fmt: skip
    shapes = QuantScheme("x", "int8", group_size=64).param_shapes(k, n, "bfloat16")
    assert {name: s for name, (s, _) in shapes.items()} == {"qweight": (256, 64), "scales": (4, 64)}
