"""One engine (`llm`) and one transformers model (`hf`) for every research test module (a module may
define its own `hf`): the engine's research variants
of the model step compile once for all of them (8-token steps: one token bucket), and transformers reads
the embedded GGUF once (about 20 s on 2 cores)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def llm(tmp_path_factory):
    from jaxllm import LLM

    # 8-token steps: prompts longer than 8 tokens are prefilled in chunks, and steps mix prefill with
    # decode rows
    return LLM(
        max_model_len=256,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        async_scheduling=True,
        compilation_cache_dir=str(tmp_path_factory.mktemp("research_xla")),
    )


@pytest.fixture(scope="session")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxllm.embedded import embedded_model_path

    path = embedded_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(autouse=True)
def torch_one_thread():
    """PyTorch's intra-op threads wait on cores JAX's own threads hold: on 2 cores a short forward pass
    took about 1 s with 2 threads and 0.12 s with 1."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
