"""The transformers peer: it runs every request through generate_batch (or, when that does not finish
them, static batches of generate, labelled so); a failing, partial or slow peer reports no figures."""

import pytest

from benchmarks import peer_transformers
from benchmarks.finished import IncompleteRun
from benchmarks.peer_transformers import CONTINUOUS, STATIC, run_peer, run_peer_subprocess

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 97,
    "max_position_embeddings": 64,
}
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def test_peer_timeout_is_reported():
    out = run_peer_subprocess({"architectures": ["LlamaForCausalLM"]}, [[1, 2]], [2], 0.0, timeout_s=0.01)
    assert out["peer"] == CONTINUOUS
    assert "did not finish" in out["error"] and "output_tok_s" not in out


def test_generate_batch_finishes_every_request():
    """In its own process, as throughput.py runs it: all 3 requests, 4 tokens each (eos never comes)."""
    out = run_peer_subprocess(TINY, PROMPTS, [4, 4, 4], 0.0, timeout_s=300)
    assert "error" not in out, out
    assert (out["peer"], out["num_requests"], out["num_finished"], out["output_tokens"]) == (
        CONTINUOUS,
        3,
        3,
        12,
    )
    assert out["generate_batch_failure"] is None
    seconds = out["generation_span_s"] or out["wall_s"]
    # The rates come from the unrounded span, the reported span is rounded to the millisecond: a span of a
    # few tens of milliseconds (a fast machine) moves the rate by up to 0.5 ms / span.
    rel = 0.01 + 0.0005 / seconds
    assert out["output_tok_s"] == pytest.approx(12 / seconds, rel=rel)
    assert out["total_tok_s"] == pytest.approx((12 + 12) / seconds, rel=rel)


def test_static_fallback_when_generate_batch_leaves_requests(monkeypatch):
    """generate_batch returning none finished (as transformers 5.17's did inside inference_mode): static
    batches of generate, named as such, with generate_batch's failure kept; when they too come up short,
    IncompleteRun, not a figure."""

    def none_finished(model, prompts, gen):
        return {"num_finished": 0, "errors": ["Inplace update to inference tensor"], "output_tokens": 0,
                "wall_s": 0.05, "generation_span_s": 0.05}  # fmt: skip

    monkeypatch.setattr(peer_transformers, "continuous", none_finished)
    out = run_peer(TINY, PROMPTS, [5, 5, 5], 0.0)
    assert out["peer"] == STATIC and "0 of 3 requests finished" in out["generate_batch_failure"]
    assert (out["num_finished"], out["output_tokens"]) == (3, 15)
    assert out["output_tok_s"] == pytest.approx(15 / out["wall_s"], rel=0.05)

    def short(model, prompts, gen, device):
        return {"num_finished": 2, "errors": [], "output_tokens": 10, "wall_s": 1.0}

    monkeypatch.setattr(peer_transformers, "static_batches", short)
    with pytest.raises(IncompleteRun, match="2 of 3 requests finished"):
        run_peer(TINY, PROMPTS, [5, 5, 5], 0.0)


def test_static_batches_generate_what_unpadded_generate_does():
    """Left padding with an attention mask leaves each prompt's greedy continuation as it is alone."""
    import torch

    model, _, _ = peer_transformers.build_model(TINY)
    gen = peer_transformers.generation_config(4, 0.0)
    seen = []
    real = model.generate

    def spy(**kw):
        out = real(**kw)
        seen.append((kw["attention_mask"], out))
        return out

    model.generate = spy
    assert peer_transformers.static_batches(model, PROMPTS, gen, "cpu")["output_tokens"] == 12
    model.generate = real
    ((mask, batch),) = seen
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            alone = model.generate(input_ids=torch.tensor([p]), generation_config=gen)
        assert batch[i, -4:].tolist() == alone[0, -4:].tolist(), i
        assert mask[i].sum().item() == len(p)
