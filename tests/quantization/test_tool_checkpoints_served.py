"""jaxllm serves the checkpoints the real quantization tools made (scripts/quant_checkpoints/build.py):

1. The weights: every projection of layer 0 that jaxllm loaded (its canonical leaves, dequantized by
   jaxllm.layers.linear.dequantize, fused parts split back, act-order rows put back) equals the tool's
   own dequantization of the same checkpoint (layer0_dense.reference), to the rounding of its scales.
2. The model: along each transformers reference's own greedy continuation (teacher-forced, so a near tie
   cannot make the runs part), jaxllm's log-probability of each token is close to transformers' with the
   same checkpoint, and jaxllm's top token is transformers' wherever that choice is clear (all but one
   position; W8A8, whose 8-bit activations amplify float32 rounding, all but three). The bound is
   loose (0.5 nats at a position, 0.06 on average) because the tools' CPU kernels do not compute
   everything in float32 (GPTQModel's torch kernel), and looser for W8A8 (1.5 / 0.15): compressed-
   tensors fake-quantizes activations with its own scale (int8: max|x| / 127.5), jaxllm as vLLM's
   kernels do (max|x| / 127), so rounding flips differ. A loader that read a nibble order, a zero point
   or a scale wrong misses by whole nats, and 1. catches a smaller slip.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm.testing.quant_checkpoints import checkpoint_names

pytestmark = pytest.mark.quant_tools

QUANTIZED = [name for name in checkpoint_names() if name != "base"]
SCHEMES = {  # what jaxllm must detect from each checkpoint's config.json
    "ct-fp8-dynamic": "fp8 W8A8 (dynamic per-token)",
    "ct-w8a8-int8": "int8 W8A8 (dynamic per-token)",
    "ct-w8a16-int8": "int8 W8A16",
    "ct-w4a16-sym": "int4 W4A16 g64",
    "ct-w4a16-asym": "int4 W4A16 g64",
    "ct-gptq-w4a16-actorder": "int4 W4A16 g64",
    "gptq-w4g64-sym-descact": "int4 W4A16 g64 act-order",
    "gptq-w4g64-asym": "int4 W4A16 g64",
    "awq-w4g64-gemm": "int4 W4A16 g64",
}
CLEAR = 0.3  # nats between the reference's first and second choice for the choice to count
PROJECTIONS = {  # jaxllm's fused projection -> the checkpoint's parts, in fused column order
    "attn/qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn/o_proj": ("self_attn.o_proj",),
    "mlp/gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp/down_proj": ("mlp.down_proj",),
}


@pytest.mark.parametrize("name", QUANTIZED)
def test_served_like_transformers(cache, name):
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jaxllm import LLM, SamplingParams
    from jaxllm.layers.linear import dequantize

    folder = cache / "checkpoints" / name
    ref = json.loads((folder / "reference.json").read_text())
    llm = LLM(str(folder), dtype="float32", max_model_len=64, compile_ahead=False)
    info = llm.llm_engine.startup_info
    assert SCHEMES[name] in info["quantization"]

    # 1. layer 0's weights against the tool's own dequantization
    tool = load_file(str(folder / "layer0_dense.reference"))
    layer = llm.llm_engine.runner.params["layers_0"]
    arch_quant = llm.llm_engine.loaded.arch.quant
    for path, parts in PROJECTIONS.items():
        leaves = layer[path.split("/")[0]][path.split("/")[1]]
        w = np.asarray(dequantize(leaves, arch_quant, jnp.float32))  # [K, N], rows in perm order
        if arch_quant.weights == "int4":  # a quarter of each weight's own quantization step
            step = np.repeat(
                np.abs(np.asarray(leaves["scales"], np.float32)), w.shape[0] // leaves["scales"].shape[0], 0
            )
        else:  # a wrong 8-bit code is 1/127 of the largest weight or more
            step = np.full(w.shape, 0.02 * np.abs(w).max())
        if "perm" in leaves:
            back = np.argsort(np.asarray(leaves["perm"]))
            w, step = w[back], step[back]
        widths = [tool[f"model.layers.0.{p}.weight"].shape[0] for p in parts]
        cuts = np.cumsum(widths)[:-1]
        for part, got, tol in zip(
            parts, np.split(w, cuts, axis=1), np.split(step, cuts, axis=1), strict=True
        ):
            want = tool[f"model.layers.0.{part}.weight"].T
            excess = np.abs(got - want) - 0.25 * tol
            assert excess.max() <= 0, (name, part, np.abs(got - want).max())

    # 2. the model's log-probabilities along the reference's continuation
    diffs, agree, decided = [], 0, 0
    for p in ref["prompts"]:
        ids = p["prompt_ids"] + p["tokens"]
        out = llm.generate(
            None, SamplingParams(max_tokens=1, prompt_logprobs=5), prompt_token_ids=[ids], use_tqdm=False
        )[0]
        start = len(p["prompt_ids"])
        for j, token in enumerate(p["tokens"]):
            position = out.prompt_logprobs[start + j]
            diffs.append(abs(position[token].logprob - p["logprobs"][j]))
            top = p["top_logprobs"][j]
            if top[0] - top[1] > CLEAR:
                decided += 1
                ours = max(position.items(), key=lambda kv: kv[1].logprob)[0]
                agree += ours == p["top_ids"][j][0]
    diffs = np.asarray(diffs)
    assert decided > 0.4 * len(diffs)
    # W8A8 rounds every projection's input to 8 bits, so a change at float32's rounding level (another
    # summation order in a GEMM: scaling fp8's f32 accumulators by 1 +- 2^-22 moves 0 to 2 of the 68 clear
    # positions of ct-fp8-dynamic) flips some codes and the flips compound over the layers
    allowed = 3 if arch_quant.activations else 1
    assert agree >= decided - allowed, (
        f"{name}: top token differs at {decided - agree} of {decided} clear positions"
    )
    # The largest single W8A8 gap moves with the CPU that built the reference (its torch summation order):
    # one build of ct-fp8-dynamic stayed under 1.0 nats, another, on another machine, gave 1.18 at a near
    # tie late in a continuation, with the mean at 0.11 and the clear top tokens within the allowance. A
    # wrong scale or code misses the mean and the top tokens by far more.
    max_d, mean_d = (1.5, 0.15) if arch_quant.activations else (0.5, 0.06)
    assert diffs.max() < max_d and diffs.mean() < mean_d, (name, diffs.max(), diffs.mean())
