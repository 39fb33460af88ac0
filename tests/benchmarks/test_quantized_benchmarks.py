"""The quantization benchmarks run end to end on a tiny model on the CPU (their figures come from the GPU).

quantized_speed: every layout loads with random weights, decodes and reports its weight bytes, which
must shrink as the layout says (fp8 and int4 against float32 here); an entry's own KV cache dtype
(METHOD@KV) reaches that entry only, and a GEMV knob (METHOD+KNOB) that entry's kernel only. perplexity:
the windows cover the text, and the figure equals exp(-mean log p) recomputed from the engine's own
prompt logprobs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import perplexity, quantized_speed


def test_quantized_speed_reports_each_layout(tmp_path):
    result = quantized_speed.main(
        ["--model", "tiny-llama", "--methods", "bf16,fp8,fp8@fp8,awq", "--offline-methods", "bf16,fp8@fp8",
         "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--decode-tokens", "4",
         "--decode-reps", "1", "--max-model-len", "32", "--output-json", str(tmp_path / "q.json")]
    )  # fmt: skip
    rows = {r["method"]: r for r in result["results"]["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["fp8"]["quantization"].startswith("fp8: fp8 W8A8")
    assert rows["awq"]["quantization"].startswith("awq: int4 W4A16")
    # the projections shrink 4x (fp8 from float32) and ~8x (int4); embeddings and norms do not
    assert rows["fp8"]["weight_bytes"] < rows["bf16"]["weight_bytes"]
    assert rows["awq"]["weight_bytes"] < rows["fp8"]["weight_bytes"]
    assert rows["bf16"]["offline_output_tok_s"] > 0 and rows["fp8"]["decode_speedup"] > 0
    # METHOD@KV: that entry alone gets the FP8 KV cache (a byte an element where the others keep 4)
    assert rows["fp8@fp8"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert {rows[m]["kv_cache_dtype"] for m in ("bf16", "fp8", "awq")} == {"float32"}
    assert rows["fp8@fp8"]["kv_cache_gib"] < rows["fp8"]["kv_cache_gib"]
    assert rows["fp8@fp8"]["offline_output_tok_s"] > 0
    assert (tmp_path / "q.json").exists()


def test_method_entries_parse_with_kv_dtype_and_gemv_knobs():
    parse = quantized_speed.parse_method
    assert parse("awq", "auto") == ("awq", "auto", {})
    assert parse("awq@fp8+pipeline+num_stages=4", "auto") == (
        "awq",
        "fp8",
        {"pipeline": True, "num_stages": 4},
    )
    for bad, match in [
        ("fp8+pipeline", "apply to awq"),
        ("awq+pipelined", "'pipelined' is not one of"),
        ("awq+num_stages=four", "whole number"),
        ("int3", "'int3' .* is not one of"),
    ]:
        with pytest.raises(SystemExit, match=match):
            parse(bad, "auto")


def test_gemv_knobs_reach_the_kernel_for_one_entry_only():
    """The kernel traced inside an entry's gemv_defaults carries the knob (its pipelined name), and the one
    traced after it does not: the jitted kernel's trace cache does not leak one entry's kernel into the next."""
    from jaxllm.kernels.w4a16_gemv import w4a16_gemv

    sds = jax.ShapeDtypeStruct
    args = (
        sds((1, 256), jnp.float32),
        sds((128, 64), jnp.uint8),
        sds((2, 64), jnp.float32),
        sds((2, 64), jnp.float32),
    )

    def kernel_jaxpr() -> str:
        return str(jax.make_jaxpr(lambda *a: w4a16_gemv(*a, interpret=True))(*args))

    before = kernel_jaxpr()
    with quantized_speed.gemv_defaults({"pipeline": True, "num_stages": 4}):
        inside = kernel_jaxpr()
    after = kernel_jaxpr()
    assert "_loopstages" not in before and "_loopstages" not in after
    assert "_loopstages4" in inside


def test_windows_cover_the_text():
    ids = list(range(100, 125))
    w = perplexity.windows(ids, 10, bos=1, max_windows=None)
    assert all(x[0] == 1 and len(x) <= 10 for x in w)
    assert [t for x in w for t in x[1:]] == ids


def test_perplexity_matches_transformers():
    """The engine's figure against transformers' own on the embedded model (float32 on the CPU)."""
    import os

    import torch
    import transformers

    from jaxllm import LLM
    from jaxllm.embedded import embedded_model_path

    llm = LLM(max_model_len=64)
    tok = llm.get_tokenizer()
    ids = tok(perplexity.reference_text(), add_special_tokens=False)["input_ids"][:120]
    prompts = perplexity.windows(ids, 48, tok.bos_token_id, None)
    ppl, count = perplexity.perplexity(llm, prompts)
    path = embedded_model_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    ).eval()
    total = 0.0
    with torch.no_grad():
        for p in prompts:
            logp = torch.log_softmax(ref(torch.tensor([p])).logits[0].double(), -1)
            total += sum(logp[i - 1, p[i]].item() for i in range(1, len(p)))
    assert count == len(ids)
    assert math.isclose(ppl, math.exp(-total / count), rel_tol=2e-3), (ppl, math.exp(-total / count))


def test_w8a8_gemm_reports_each_shape_against_the_dequantized_reference(tmp_path):
    """Every projection shape of the model at every token count, both kinds, each with its error against
    dequantize-then-dot small enough that the layer computed the same product (8-bit rounding only)."""
    from benchmarks import w8a8_gemm

    result = w8a8_gemm.main(
        ["--model", "tiny-llama", "--tokens", "1,4", "--layers", "2", "--warmup", "1", "--reps", "2",
         "--kinds", "fp8,int8,fp8-weight-only", "--output-json", str(tmp_path / "g.json")]
    )  # fmt: skip
    rows = result["results"]["rows"]
    assert {r["kind"] for r in rows} == {"fp8", "int8", "fp8-weight-only"}
    assert len(rows) == 3 * 4 * 2  # kinds x projection groups (qkv, o, gate_up, down) x token counts
    for r in rows:
        # activations rounded to 8 bits per token; unquantized, only the bf16 output's rounding is left
        bound = 0.01 if r["kind"].endswith("weight-only") else 0.08
        assert r["max_rel_err_vs_dequantized"] < bound, r
        assert r["bf16_us"] > 0 and r["w8a8_us"] > 0
    assert (tmp_path / "g.json").exists()
