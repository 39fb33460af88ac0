"""A tiny transformers Llama, quantized, loaded by jaxllm and compared with transformers (CPU, float32).

--quantization fp8 on the float checkpoint: jaxllm quantizes weights (per channel) and activations (per
    token) to e4m3. The reference is transformers with each projection's weight replaced by its fp8
    round trip and each projection's input rounded to fp8 per token by a hook; the same model without
    the weight round trip, or without the input rounding, must miss the bound (the test can fail).
W4A16 checkpoints in the AWQ and GPTQ (v1, act order) packings written by the test's own packer:
    transformers runs the weights the codes dequantize to; logits match to 1e-4, greedy tokens equal.
Bad input: a module without qzeros, bits 3, a flag naming another method, a float weight among
    quantized ones -> one-line ValueErrors naming the tensor or the field.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402
from tests.models.test_hf_families import LLAMA, make_hf_model, prompts_for  # noqa: E402
from tests.quantization.checkpoints import decoder_projections, with_weights, write_quantized  # noqa: E402

NEW_TOKENS = 12
# init 0.3 (as the engine tests' tiny models): logits spread far apart, greedy choices far from ties
CONFIG = dict(LLAMA, tie_word_embeddings=False, initializer_range=0.3)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("LlamaConfig", CONFIG, seed=11)


@pytest.fixture(scope="module")
def float_folder(hf_model, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("float_llama"))
    hf_model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_logits_and_tokens(model, prompts):
    """(logits per prompt f32[L, V], NEW_TOKENS greedy tokens per prompt), one prompt at a time. Greedy by
    full forwards rather than generate(), whose min_new_tokens would forbid the end-of-text token that
    jaxllm (ignoring it) may pick."""
    logits, tokens = [], []
    with torch.no_grad():
        for p in prompts:
            logits.append(model(torch.tensor([p])).logits[0].float().numpy())
            seq = list(p)
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            tokens.append(seq[len(p) :])
    return logits, tokens


def jaxllm_logits_and_tokens(folder: str, prompts, **spec):
    loaded = load_model(ModelSpec(model=folder, dtype="float32", **spec))
    logits = PagedRunner(loaded, max_len=64).prefill(prompts)
    tokens = PagedRunner(loaded, max_len=64, seed=1).greedy(prompts, NEW_TOKENS)
    return loaded, logits, tokens


# --- fp8 (W8A8, quantized at load) -------------------------------------------------------------------


def fp8_round_trip(w: np.ndarray) -> np.ndarray:
    """torch weight [N, K] -> its e4m3 round trip with one scale per output channel (max|w| / 448)."""
    s = (np.abs(w).max(axis=1, keepdims=True) / np.float32(448)).astype(np.float32)
    return (np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).astype(
        np.float32
    )


def quantized_inputs(model, kind: str = "fp8", static: dict[str, float] | None = None) -> list:
    """Hooks that round each projection's input per token to e4m3 (scale max|x| / 448) or to int8 (scale
    max|x| / 127, round half to even), as W8A8 does; with `static` {module: scale}, by that fixed scale."""
    qmax = 448.0 if kind == "fp8" else 127.0

    def hook_for(name):
        def hook(_module, args):
            x = args[0].float()
            if static is None:
                s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
            else:
                s = torch.tensor(static[name], dtype=torch.float32)
            xs = (x / s).clamp(-qmax, qmax)
            xq = xs.to(torch.float8_e4m3fn).to(torch.float32) if kind == "fp8" else torch.round(xs)
            return (xq * s,)

        return hook

    return [linear.register_forward_pre_hook(hook_for(n)) for n, linear, _ in decoder_projections(model)]


def max_error(ours, ref) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(ours, ref, strict=True))


def test_fp8_online_matches_transformers_with_fp8_weights_and_inputs(hf_model, float_folder):
    prompts = prompts_for(0)
    loaded, logits, tokens = jaxllm_logits_and_tokens(float_folder, prompts, quantization="fp8")
    assert loaded.arch.quant is not None and loaded.arch.quant.describe().startswith("fp8: fp8 W8A8")
    qkv = loaded.params["layers_0"]["attn"]["qkv_proj"]
    assert str(qkv["qweight"].dtype) == "float8_e4m3fn" and "kernel" not in qkv
    assert str(qkv["weight_scale"].dtype) == "float32"
    # W8A8 holds the fused weight [N, K] (out, in), fused along its first axis
    assert qkv["qweight"].shape == (*qkv["weight_scale"].shape, loaded.arch.hidden_size)

    fp8_weights = {
        n: fp8_round_trip(lin.weight.detach().numpy()) for n, lin, _ in decoder_projections(hf_model)
    }
    ref_model = with_weights(hf_model, fp8_weights)
    hooks = quantized_inputs(ref_model)
    ref_logits, ref_tokens = hf_logits_and_tokens(ref_model, prompts)
    scale = max(float(np.max(np.abs(r))) for r in ref_logits)
    err = max_error(logits, ref_logits)
    bound = 2e-3 * scale  # an input rounded the other way at an e4m3 tie moves a logit by ~1e-4 of scale
    assert err < bound, f"fp8 logits differ from the fp8 reference by {err} (scale {scale})"
    assert tokens == ref_tokens

    # the bound is tight: transformers without the weight round trip, or without the input rounding, misses it
    for h in hooks:
        h.remove()
    weights_only = hf_logits_and_tokens(ref_model, prompts)[0]
    hooks = quantized_inputs(hf_model)
    try:
        inputs_only = hf_logits_and_tokens(hf_model, prompts)[0]
    finally:
        for h in hooks:
            h.remove()
    assert max_error(logits, weights_only) > 5 * bound
    assert max_error(logits, inputs_only) > 5 * bound


def test_int8_w8a8_checkpoint_matches_transformers_with_int8_weights_and_inputs(hf_model, tmp_path):
    folder = str(tmp_path / "w8a8")
    weights = write_quantized(hf_model, folder, "ct-w8a8-int8")
    prompts = prompts_for(2)
    loaded, logits, tokens = jaxllm_logits_and_tokens(folder, prompts)
    assert loaded.arch.quant.describe() == "compressed-tensors: int8 W8A8 (dynamic per-token)"
    ref_model = with_weights(hf_model, weights)
    hooks = quantized_inputs(ref_model, "int8")
    ref_logits, ref_tokens = hf_logits_and_tokens(ref_model, prompts)
    for h in hooks:
        h.remove()
    scale = max(float(np.max(np.abs(r))) for r in ref_logits)
    bound = 2e-3 * scale
    assert max_error(logits, ref_logits) < bound
    assert tokens == ref_tokens
    # without the input rounding transformers misses the bound: jaxllm does quantize its activations
    assert max_error(logits, hf_logits_and_tokens(ref_model, prompts)[0]) > 5 * bound


def test_fp8_static_checkpoint_matches_transformers(hf_model, tmp_path):
    """The HF/vLLM fp8 format with static input scales: q, k and v (and gate, up) are fused into one GEMM
    whose input is quantized with the largest of their input scales (vLLM's rule)."""
    folder = str(tmp_path / "fp8")
    scales: dict[str, float] = {}
    weights = write_quantized(hf_model, folder, "fp8-static", input_scales=scales)
    fused = {}
    for name, _, key in decoder_projections(hf_model):
        fused[key] = max(fused.get(key, 0.0), scales[name])
    static = {name: fused[key] for name, _, key in decoder_projections(hf_model)}
    prompts = prompts_for(3)
    loaded, logits, tokens = jaxllm_logits_and_tokens(folder, prompts)
    assert loaded.arch.quant.describe() == "fp8: fp8 W8A8 (static input scale)"
    ref_model = with_weights(hf_model, weights)
    hooks = quantized_inputs(ref_model, "fp8", static)
    ref_logits, ref_tokens = hf_logits_and_tokens(ref_model, prompts)
    for h in hooks:
        h.remove()
    bound = 2e-3 * max(float(np.max(np.abs(r))) for r in ref_logits)
    assert max_error(logits, ref_logits) < bound
    assert tokens == ref_tokens
    # each projection with its own input scale (no max over the fused ones) misses the bound
    hooks = quantized_inputs(ref_model, "fp8", scales)
    try:
        assert max_error(logits, hf_logits_and_tokens(ref_model, prompts)[0]) > 5 * bound
    finally:
        for h in hooks:
            h.remove()


# --- W4A16 checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "act_order"), [("awq", False), ("gptq", True), ("ct-w4a16", True)])
def test_w4a16_checkpoint_matches_transformers(hf_model, tmp_path, method, act_order):
    folder = str(tmp_path / method)
    weights = write_quantized(hf_model, folder, method, group=32, act_order=act_order)
    prompts = prompts_for(1)
    loaded, logits, tokens = jaxllm_logits_and_tokens(folder, prompts)
    quant = loaded.arch.quant
    want_method = "compressed-tensors" if method.startswith("ct") else method
    assert (quant.method, quant.weights, quant.group_size, quant.act_order) == (
        want_method,
        "int4",
        32,
        act_order,
    )
    assert ("perm" in loaded.params["layers_0"]["attn"]["qkv_proj"]) == act_order
    ref_logits, ref_tokens = hf_logits_and_tokens(with_weights(hf_model, weights), prompts)
    for ours, ref in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert tokens == ref_tokens
    # the check can fail: the float model's logits are far from the 4-bit ones
    float_logits = hf_logits_and_tokens(hf_model, prompts[:1])[0]
    assert np.max(np.abs(float_logits[0] - logits[0])) > 100 * 1e-4


# --- bad input ----------------------------------------------------------------------------------------


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_missing_qzeros_names_the_tensor(hf_model, tmp_path):
    folder = str(tmp_path / "awq")
    write_quantized(hf_model, folder, "awq", drop="model.layers.1.mlp.down_proj.qzeros")
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=folder, dtype="float32"))
    assert "model.layers.1.mlp.down_proj.qzeros" in one_line(e)


def test_bits_3_names_the_field(hf_model, tmp_path):
    folder = str(tmp_path / "awq")
    write_quantized(hf_model, folder, "awq")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["bits"] = 3
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=folder, dtype="float32"))
    assert "quantization_config.bits=3" in one_line(e) and folder in one_line(e)


def test_flag_naming_another_method(hf_model, tmp_path, float_folder):
    folder = str(tmp_path / "gptq")
    write_quantized(hf_model, folder, "gptq_v2")
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=folder, dtype="float32", quantization="awq"))
    assert "quantization='awq'" in one_line(e) and "quant_method='gptq'" in one_line(e)
    with pytest.raises(ValueError) as e:  # a float checkpoint is quantized at load only by fp8
        load_model(ModelSpec(model=float_folder, dtype="float32", quantization="gptq"))
    assert "has no quantization_config" in one_line(e)


def test_float_weight_among_quantized_names_the_tensor(hf_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = str(tmp_path / "awq")
    write_quantized(hf_model, folder, "awq")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj"
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"{name}.{suffix}"]
    tensors[f"{name}.weight"] = hf_model.state_dict()[f"{name}.weight"].numpy()
    save_file(tensors, path)
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=folder, dtype="float32"))
    assert f"{name}.weight" in one_line(e) and "quantized" in one_line(e)
