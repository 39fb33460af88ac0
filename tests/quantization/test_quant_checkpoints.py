"""The quantized checkpoints built by the real tools (scripts/quant_checkpoints/build.py): each holds the
layout its format defines, agreeing with what the tool itself allocates and dequantizes, and the
transformers references beside them are real runs of quantized models.

Layouts (K inputs, N outputs, group size g; torch's weight is [N, K]):
  compressed-tensors float-/int-quantized   weight fp8/i8[N, K], weight_scale [N, 1]
  compressed-tensors pack-quantized         weight_packed i32[N, K/p] (p = 32/bits values per word, low
                                            first, stored q + 2^(bits-1)), weight_scale [N, K/g],
                                            weight_shape i64[2], asymmetric: weight_zero_point
                                            i32[N/p, K/g] (packed along N); W8A16 is saved this way too
  GPTQ (v1)                                 qweight i32[K/8, N], qzeros i32[K/g, N/8] (zero - 1),
                                            scales f16[K/g, N], g_idx i32[K]
  AWQ GEMM                                  qweight i32[K, N/8], qzeros i32[K/g, N/8] (nibble i of a word
                                            holds column 8j + [0,2,4,6,1,3,5,7][i]), scales f16[K/g, N]
The unpacking below is written from these descriptions and checked against the tool's own dequantized
layer 0 (layer0_dense.reference), so a wrong nibble order or zero offset fails here first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxllm.testing.quant_checkpoints import checkpoint_names

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.quant_tools

QUANTIZED = [name for name in checkpoint_names() if name != "base"]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]


def _folder(cache: Path, name: str) -> Path:
    return cache / "checkpoints" / name


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection, from config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def _format(qconfig: dict) -> str:
    method = qconfig["quant_method"]
    return qconfig["format"] if method == "compressed-tensors" else method


def _group_size(qconfig: dict, k: int) -> int:
    if qconfig["quant_method"] == "compressed-tensors":
        weights = qconfig["config_groups"]["group_0"]["weights"]
        return weights["group_size"] if weights["strategy"] == "group" else k
    return qconfig["group_size"]


def _bits(qconfig: dict) -> int:
    if qconfig["quant_method"] == "compressed-tensors":
        return qconfig["config_groups"]["group_0"]["weights"]["num_bits"]
    return qconfig["bits"]


def _expected_layout(fmt: str, qconfig: dict, k: int, n: int, g: int) -> dict[str, tuple[str, tuple]]:
    """name -> (dtype, shape) as the format defines it (module docstring); float dtypes as "float"."""
    if fmt in ("float-quantized", "int-quantized"):
        weight = "float8_e4m3fn" if fmt == "float-quantized" else "int8"
        return {"weight": (weight, (n, k)), "weight_scale": ("float", (n, 1))}
    if fmt == "pack-quantized":
        p = 32 // qconfig["config_groups"]["group_0"]["weights"]["num_bits"]
        out = {
            "weight_packed": ("int32", (n, k // p)),
            "weight_scale": ("float", (n, k // g)),
            "weight_shape": ("int64", (2,)),
        }
        if not qconfig["config_groups"]["group_0"]["weights"]["symmetric"]:
            out["weight_zero_point"] = ("int32", (n // p, k // g))
        return out
    if fmt == "gptq":
        return {
            "qweight": ("int32", (k // 8, n)),
            "qzeros": ("int32", (k // g, n // 8)),
            "scales": ("float16", (k // g, n)),
            "g_idx": ("int32", (k,)),
        }
    if fmt == "awq":
        return {
            "qweight": ("int32", (k, n // 8)),
            "qzeros": ("int32", (k // g, n // 8)),
            "scales": ("float16", (k // g, n)),
        }
    raise AssertionError(fmt)


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


@pytest.mark.parametrize("name", QUANTIZED)
def test_layout_matches_format_and_tool(cache, name):
    folder = _folder(cache, name)
    config = _json(folder / "config.json")
    qconfig = config["quantization_config"]
    tool = _json(folder / "tool_metadata.json")
    fmt = _format(qconfig)
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    float_dtype = config["torch_dtype"] if qconfig["quant_method"] == "compressed-tensors" else "float16"

    # lm_head is ignored and tied: no lm_head tensor; the embedding stays in the checkpoint's dtype.
    assert not any(key.startswith("lm_head") for key in tensors)
    assert _dtype_name(tensors["model.embed_tokens.weight"]) == config["torch_dtype"]
    for layer in range(config["num_hidden_layers"]):
        for linear, (k, n) in _linear_shapes(config).items():
            prefix = f"model.layers.{layer}.{linear}."
            found = {key.removeprefix(prefix): t for key, t in tensors.items() if key.startswith(prefix)}
            expected = _expected_layout(fmt, qconfig, k, n, _group_size(qconfig, k))
            assert set(found) == set(expected), (prefix, sorted(found))
            for key, (dtype, shape) in expected.items():
                assert tuple(found[key].shape) == shape, (prefix + key, found[key].shape)
                assert _dtype_name(found[key]) == (float_dtype if dtype == "float" else dtype), prefix + key
            if layer == 0:  # the tool's kernel allocated the same names and shapes when loading
                allocated = tool["layer0"][linear]["tensors"]
                assert set(allocated) == set(found), (linear, sorted(allocated))
                for key, spec in allocated.items():
                    assert tuple(spec["shape"]) == tuple(found[key].shape), (linear, key)
                    if not found[key].is_floating_point():
                        assert spec["dtype"] == _dtype_name(found[key]), (linear, key)
    if fmt == "pack-quantized":
        shape = tensors["model.layers.0.self_attn.q_proj.weight_shape"].tolist()
        assert shape == list(reversed(_linear_shapes(config)["self_attn.q_proj"]))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantization_config_matches_tool(cache, name):
    folder = _folder(cache, name)
    qconfig = _json(folder / "config.json")["quantization_config"]
    tool = _json(folder / "tool_metadata.json")["quantization_config"]
    assert tool is not None, "the tool could not read its own config back"
    if qconfig["quant_method"] == "compressed-tensors":
        ours, theirs = qconfig["config_groups"]["group_0"], tool["config"]["config_groups"]["group_0"]
        for field in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder"):
            assert ours["weights"][field] == theirs["weights"][field], field
        if theirs["input_activations"] is None:
            assert ours.get("input_activations") is None
        else:  # W8A8 / FP8: activations quantized per token, dynamic, at run time
            for field in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
                assert ours["input_activations"][field] == theirs["input_activations"][field], field
            assert (ours["input_activations"]["strategy"], ours["input_activations"]["dynamic"]) == (
                "token",
                True,
            )
        assert qconfig["format"] == tool["config"]["format"] == ours["format"]
        assert set(tool["compression_param_names"]["group_0"]) <= {
            key for spec in _json(folder / "tool_metadata.json")["layer0"].values() for key in spec["tensors"]
        }
        assert qconfig["ignore"] == ["lm_head"]
    else:
        written = tool["config"]  # quantize_config.json, the tool's own file
        for field in ("bits", "group_size", "desc_act", "quant_method", "checkpoint_format"):
            assert qconfig[field] == written[field], field
        if qconfig["quant_method"] == "gptq":
            assert qconfig["checkpoint_format"] == "gptq"  # v1: qzeros hold zero - 1
            assert qconfig["sym"] == written["sym"]
        else:
            assert qconfig["version"] == "gemm" and qconfig["zero_point"] == written["zero_point"]


def _nibbles(words, axis: int, bits: int = 4):
    """i32 words -> their 32/bits fields (low first), unpacked along `axis` (which grows 32/bits times)."""
    per_word = 32 // bits
    words = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    nib = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, per_word]
    if axis == 0:
        nib = nib.permute(0, 2, 1)  # [rows, per_word, cols]
        return nib.reshape(words.shape[0] * per_word, words.shape[1])
    return nib.reshape(words.shape[0], words.shape[1] * per_word)


def _dequantize(fmt: str, p: dict, k: int, n: int, g: int, bits: int):
    """(w, step): f32[N, K] weights from the checkpoint's tensors of one Linear, per the layouts in the
    module docstring, and f32[N, K] the scale each element was quantized with (one quantization step)."""
    if fmt in ("float-quantized", "int-quantized"):
        scale = p["weight_scale"].float().expand(n, k)
        return p["weight"].float() * scale, scale
    if fmt == "pack-quantized":
        offset = 1 << (bits - 1)
        q = _nibbles(p["weight_packed"], axis=1, bits=bits) - offset  # [N, K]
        zero = 0
        if "weight_zero_point" in p:
            zero = _nibbles(p["weight_zero_point"], axis=0, bits=bits) - offset  # [N, K/g]
            zero = zero.repeat_interleave(g, dim=1)  # [N, K]
        scale = p["weight_scale"].float().repeat_interleave(g, dim=1)  # [N, K]
        return (q - zero).float() * scale, scale
    if fmt == "gptq":
        q = _nibbles(p["qweight"], axis=0)  # [K, N]
        zeros = _nibbles(p["qzeros"], axis=1) + 1  # [K/g, N], v1 stores zero - 1
        g_idx = p["g_idx"].long()
        scale = p["scales"].float()[g_idx]  # [K, N]
        return ((q - zeros[g_idx]).float() * scale).T, scale.T
    if fmt == "awq":
        order = torch.tensor(AWQ_ORDER)
        inverse = torch.argsort(order)  # column 8j + c sits in nibble inverse[c]

        def unpack(words):
            nib = _nibbles(words, axis=1).reshape(words.shape[0], -1, 8)
            return nib[:, :, inverse].reshape(words.shape[0], -1)

        q, zeros = unpack(p["qweight"]), unpack(p["qzeros"])  # [K, N], [K/g, N]
        rows = torch.arange(k) // g
        scale = p["scales"].float()[rows]  # [K, N]
        return ((q - zeros[rows]).float() * scale).T, scale.T
    raise AssertionError(fmt)


@pytest.mark.parametrize("name", QUANTIZED)
def test_unpacking_matches_tool_dequantization(cache, name):
    folder = _folder(cache, name)
    config = _json(folder / "config.json")
    qconfig = config["quantization_config"]
    fmt = _format(qconfig)
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    dense = safetensors_torch.load_file(str(folder / "layer0_dense.reference"))
    for linear, (k, n) in _linear_shapes(config).items():
        prefix = f"model.layers.0.{linear}."
        params = {key.removeprefix(prefix): t for key, t in tensors.items() if key.startswith(prefix)}
        ours, step = _dequantize(fmt, params, k, n, _group_size(qconfig, k), _bits(qconfig))
        theirs = dense[prefix + "weight"]
        assert ours.shape == theirs.shape == (n, k)
        # A wrong nibble, zero point or group is off by at least one quantization step. GPTQModel's
        # kernels subtract a precomputed zero * scale in half precision, which leaves up to about a
        # tenth of a step (a few thousandths on average); compressed-tensors' decompression is exact.
        error = (ours - theirs).abs() / step
        assert error.max().item() < 0.25, (name, linear, error.max().item())
        assert error.mean().item() < 0.02, (name, linear, error.mean().item())


def _reference(cache: Path, name: str) -> dict:
    return _json(_folder(cache, name) / "reference.json")


@pytest.mark.parametrize("name", ["base", *QUANTIZED])
def test_reference_is_consistent(cache, name):
    reference, base = _reference(cache, name), _reference(cache, "base")
    assert reference["compute_dtype"] == "float32"
    assert [p["prompt_ids"] for p in reference["prompts"]] == [p["prompt_ids"] for p in base["prompts"]]
    assert len(reference["prompts"]) >= 4
    n, top_k = reference["num_new_tokens"], reference["top_k"]
    for prompt in reference["prompts"]:
        assert len(prompt["tokens"]) == len(prompt["forced_logprobs"]) == n
        assert prompt["base_tokens"] == base["prompts"][reference["prompts"].index(prompt)]["tokens"]
        for step in range(n):
            ids, lps = prompt["top_ids"][step], prompt["top_logprobs"][step]
            assert len(ids) == top_k and lps == sorted(lps, reverse=True) and lps[0] <= 0
            assert prompt["tokens"][step] == ids[0] and prompt["logprobs"][step] == lps[0]
    if name == "base":  # greedy with the KV cache and one full forward see the same distributions
        for prompt in reference["prompts"]:
            assert [ids[0] for ids in prompt["forced_top_ids"]] == prompt["tokens"]
            diffs = [abs(a - b) for a, b in zip(prompt["forced_logprobs"], prompt["logprobs"])]
            assert max(diffs) < 1e-3


def _forced_agreement(reference: dict) -> float:
    """Share of positions where the model's argmax along the base's greedy continuation is the base's token."""
    hits = total = 0
    for prompt in reference["prompts"]:
        for ids, token in zip(prompt["forced_top_ids"], prompt["base_tokens"]):
            hits += ids[0] == token
            total += 1
    return hits / total


def _forced_drift(reference: dict, base: dict) -> float:
    """Mean |logprob difference| of the base's tokens, quantized vs base, along the base's continuation."""
    diffs = [
        abs(a - b)
        for prompt, base_prompt in zip(reference["prompts"], base["prompts"])
        for a, b in zip(prompt["forced_logprobs"], base_prompt["logprobs"])
    ]
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("name", ["ct-fp8-dynamic", "ct-w8a8-int8", "ct-w8a16-int8"])
def test_8bit_references_follow_the_base(cache, name):
    """8-bit quantization barely moves this model: along the base's greedy continuation it picks the same
    token at most positions, with a small logprob drift, yet not zero (the tool really quantized).
    Free-running greedy tokens are not compared: one flip at a near tie changes every later position."""
    reference, base = _reference(cache, name), _reference(cache, "base")
    assert _forced_agreement(reference) >= 0.8
    drift = _forced_drift(reference, base)
    assert 0 < drift < 0.3
    first_tokens = [p["tokens"][0] == b["tokens"][0] for p, b in zip(reference["prompts"], base["prompts"])]
    assert sum(first_tokens) >= len(first_tokens) - 1


def test_4bit_drifts_more_than_8bit(cache):
    base = _reference(cache, "base")
    fp8 = _forced_drift(_reference(cache, "ct-fp8-dynamic"), base)
    for name in QUANTIZED:
        if "w4" in name:
            drift = _forced_drift(_reference(cache, name), base)
            assert fp8 < drift < 1.5, name
            assert _forced_agreement(_reference(cache, name)) >= 0.5, name
