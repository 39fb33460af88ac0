"""The embedded SmolLM2-135M GGUF (Q8_0/Q4_1/F32) against transformers loading the same file: greedy
continuations of three prompts must be identical; the orbax cache must restore the same params."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.embedded import embedded_model_path  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.loader.checkpoint import CheckpointCache  # noqa: E402
from jaxllm.loader.loader import params_layout  # noqa: E402
from jaxllm.tokenizer import apply_chat_template  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("orbax"))
    first = load_model(ModelSpec(checkpoint_dir=cache))
    return first, cache


def test_embedded_greedy_matches_transformers(embedded):
    loaded, _ = embedded
    assert loaded.model_name == "SmolLM2-135M-Instruct" and not loaded.from_cache
    assert loaded.dtype == np.float32 and loaded.arch.tie_word_embeddings
    tok = loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours = PagedRunner(loaded, max_len=64, block_size=16).greedy(prompts, NEW_TOKENS)

    path = embedded_model_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p, got in zip(prompts, ours, strict=True):
            out = ref.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS
            )
            assert got == out[0, len(p) :].tolist(), tok.decode(got)


def test_orbax_cache_restores_same_params(embedded, caplog):
    first, cache = embedded
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        second = load_model(ModelSpec(checkpoint_dir=cache))
    assert second.from_cache and "orbax" in caplog.text
    assert second.arch.layer_quant == first.arch.layer_quant is not None  # rebuilt from the cached config
    flat1, flat2 = jax.tree.leaves_with_path(first.params), jax.tree.leaves_with_path(second.params)
    assert [k for k, _ in flat1] == [k for k, _ in flat2]
    for (_, a), (_, b) in zip(flat1, flat2, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert second.tokenizer("hello world")["input_ids"] == first.tokenizer("hello world")["input_ids"]
    # another dtype, another source or another layout (tensor-parallel size; the float tree of the
    # dequantized file, which caches made before GGUF stayed quantized hold) must not reuse this cache
    gguf1 = params_layout(1, kind="gguf")
    assert CheckpointCache(cache, embedded_model_path(), "auto", gguf1).valid()
    assert not CheckpointCache(cache, embedded_model_path(), "bfloat16", gguf1).valid()
    assert not CheckpointCache(cache, os.path.dirname(embedded_model_path()), "auto", gguf1).valid()
    assert not CheckpointCache(cache, embedded_model_path(), "auto", params_layout(2, kind="gguf")).valid()
    assert not CheckpointCache(cache, embedded_model_path(), "auto", params_layout(1)).valid()


def test_embedded_chat_template(embedded):
    tok = embedded[0].tokenizer
    text = apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
