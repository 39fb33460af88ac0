"""A request stopped by a token (a stop_token_id or end of sequence) keeps that token in token_ids but not in
its text, as vLLM does: with skip_special_tokens=False an end-of-sequence marker would otherwise show, and
tool-call parsers that need special tokens in the text would see it. include_stop_str_in_output keeps it."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, jax_cache_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=128, compilation_cache_dir=jax_cache_dir)


def test_stop_token_adds_no_text(llm):
    tok = llm.get_tokenizer()
    prompt = [[5, 6, 7, 8]]
    (free,) = llm.generate(
        None,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        prompt_token_ids=prompt,
        use_tqdm=False,
    )
    ids = free.outputs[0].token_ids
    stop_id = ids[3]
    k = ids.index(stop_id)  # its first occurrence ends the request
    for kw, with_text in (({}, False), ({"include_stop_str_in_output": True}, True)):
        params = SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[stop_id], skip_special_tokens=False, **kw
        )
        (out,) = llm.generate(None, params, prompt_token_ids=prompt, use_tqdm=False)
        o = out.outputs[0]
        assert o.token_ids == ids[: k + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
        assert o.text == tok.decode(ids[: k + 1] if with_text else ids[:k], skip_special_tokens=False)
    # end of sequence, shown as text only when special tokens are not skipped
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}, skip_special_tokens=False)
    (out,) = llm.generate(None, params, prompt_token_ids=prompt, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].text == ""
