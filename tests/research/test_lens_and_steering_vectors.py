"""jaxllm.research on the embedded SmolLM2-135M in float32, through the real engine (chunked prefill: 8-token
steps), against transformers loading the same GGUF file: the logit lens of the last layer is the logits
the engine computed, the lens of the other layers is transformers' lm_head(norm(hidden_states[i + 1])),
a steering vector is the mean difference of transformers' hidden states over the pairs, and the pandas
frames hold what the arrays hold.

One engine, one token bucket: the engine compiles two research variants of its step here (every residual
with logits; one site without), not one per test."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

from jaxllm import ResearchParams, SamplingParams  # noqa: E402
from jaxllm.research import (  # noqa: E402
    apply_logit_lens,
    captures_frame,
    lens_logits,
    logit_lens,
    sequence_token_ids,
    steering_vector,
    top_tokens_frame,
)

PROMPT = "The Eiffel Tower is in the city of Paris, and the Colosseum is in the city of"
NEW = 4
PAIRS = [
    ("I loved the film. It was", "I hated the film. It was"),
    ("What a wonderful day, I feel", "What an awful day, I feel"),
    ("The service was excellent and the staff", "The service was terrible and the staff"),
]


@pytest.fixture(scope="module")
def num_layers(llm):
    return llm.llm_engine.loaded.arch.num_layers


@pytest.fixture(scope="module")
def lensed(llm, num_layers):
    """Every residual and the logits at every position of a greedy request, and their lens."""
    capture = [f"residual.{i}" for i in range(num_layers)] + ["logits"]
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, research=ResearchParams(capture=capture)
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.prompt_token_ids) > 8  # the prompt is prefilled in chunks
    seq = sequence_token_ids(out)
    return out, apply_logit_lens(llm, out.outputs[0].captures, seq), seq[:-1]


def hf_lens(hf, ids: list[int], layers) -> dict[int, np.ndarray]:
    """Layer i -> f32[T, V]: transformers' lm_head(norm(layer i's output))."""
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        n = len(hs) - 1
        # hidden_states[i + 1] is layer i's output; the last entry already has the final norm applied
        normed = {i: hs[-1][0] if i == n - 1 else hf.model.norm(hs[i + 1][0]) for i in layers}
        return {i: hf.lm_head(h).numpy() for i, h in normed.items()}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_last_layer_lens_is_the_engines_logits(lensed, num_layers):
    out, lens, ids = lensed
    assert lens.layers == list(range(num_layers)) and lens.positions == list(range(len(ids)))
    assert lens.token_ids == ids
    captured = out.outputs[0].captures.arrays["logits"]  # f32[P, V]
    assert rel_err(lens.logits[-1], captured) <= 1e-6
    # the greedy tokens are the last layer's top-1 at the last prompt position onwards
    top, _ = lens.top_tokens(1)
    assert list(top[-1, len(out.prompt_token_ids) - 1 :, 0]) == out.outputs[0].token_ids


def test_layers_lens_equals_transformers_norm_and_head(lensed, hf, num_layers):
    _, lens, ids = lensed
    layers = (0, 7, 15, num_layers - 2, num_layers - 1)
    want = hf_lens(hf, ids, layers)
    for i in layers:
        assert rel_err(lens.logits[i], want[i]) <= 1e-4, i
    # top tokens: the reference's top-1 and its log-softmax at the ids the lens ranks first
    top, logprobs = lens.top_tokens(5)
    for i in layers:
        assert (top[i, :, 0] == want[i].argmax(-1)).mean() > 0.9, i  # near-ties may swap in float32
        ref_lp = log_softmax(want[i])
        np.testing.assert_allclose(logprobs[i], np.take_along_axis(ref_lp, top[i], axis=-1), atol=2e-4)
    assert np.all(np.diff(logprobs, axis=-1) <= 0)
    # the lens is not the identity on layers: early layers predict other tokens than the last
    assert (top[0, :, 0] != top[-1, :, 0]).mean() > 0.5


def test_logit_lens_runs_the_engine_on_token_ids(llm, hf):
    ids = llm.get_tokenizer()("The capital of France is")["input_ids"]
    lens, logits = logit_lens(llm, ids, with_logits=True)
    assert lens.positions == list(range(len(ids))) and lens.token_ids == ids
    assert rel_err(lens.logits[-1], logits) <= 1e-6
    assert rel_err(lens.logits[11], hf_lens(hf, ids, [11])[11]) <= 1e-4


def test_lens_logits_is_rms_norm_then_the_tied_head(llm):
    """Bare rows against numpy: x / rms(x) * scale, times the embedding transposed (the model ties them)."""
    loaded = llm.llm_engine.loaded
    arch, params = loaded.arch, loaded.params
    assert arch.tie_word_embeddings and "lm_head" not in params
    rows = 3.0 * np.random.default_rng(0).standard_normal((3, arch.hidden_size)).astype(np.float32)
    x = rows.astype(np.float64)
    normed = (
        x / np.sqrt((x * x).mean(-1, keepdims=True) + arch.rms_norm_eps) * np.asarray(params["norm"]["scale"])
    )
    want = normed @ np.asarray(params["embed_tokens"]["embedding"], np.float64).T  # [3, V]
    three = lens_logits(llm, rows)
    assert three.dtype == np.float32 and rel_err(three, want) <= 1e-5
    assert rel_err(lens_logits(llm, rows[:1]), want[:1]) <= 1e-5  # another row bucket, the same rows


def test_steering_vector_is_the_mean_difference_of_transformers_hidden_states(llm, hf):
    tok = llm.get_tokenizer()
    diffs = []
    for pos, neg in PAIRS:
        last = []
        for text in (pos, neg):
            with torch.no_grad():
                hs = hf(torch.tensor([tok(text)["input_ids"]]), output_hidden_states=True).hidden_states
            last.append(hs[10][0, -1].numpy())  # residual.9 at the last prompt token
        diffs.append(last[0] - last[1])
    want = np.mean(diffs, axis=0)
    # prompts as text or token ids, in one engine batch
    pairs = [(tok(PAIRS[0][0])["input_ids"], PAIRS[0][1]), *PAIRS[1:]]
    got = steering_vector(llm, pairs, "residual.9")
    assert got.dtype == np.float32 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-4
    # the check can fail: one pair alone gives another vector
    assert rel_err(steering_vector(llm, PAIRS[:1], "residual.9"), want) > 1e-2


def test_bad_arguments_are_refused(llm, lensed):
    with pytest.raises(ValueError, match="pairs"):
        steering_vector(llm, [], "residual.1")
    with pytest.raises(ValueError, match=r"pairs\[0\]"):
        steering_vector(llm, [("a", "b", "c")], "residual.1")
    with pytest.raises(ValueError, match="site"):
        steering_vector(llm, PAIRS, "logits")
    with pytest.raises(ValueError, match="layers"):
        apply_logit_lens(llm, lensed[0].outputs[0].captures, layers=[31])
    with pytest.raises(ValueError, match="hidden"):
        lens_logits(llm, np.zeros((2, 7), np.float32))


def test_captures_frame_holds_the_arrays(llm, lensed, num_layers):
    out, _, ids = lensed
    tok = llm.get_tokenizer()
    caps = out.outputs[0].captures
    df = captures_frame(out, tok)
    p = len(caps.positions)
    assert len(df) == (num_layers + 1) * p
    assert list(df.columns) == [
        "site",
        "kind",
        "layer",
        "position",
        "token_id",
        "token",
        "norm",
        "mean",
        "std",
        "max_abs",
    ]
    r = df[df["site"] == "residual.7"]
    assert list(r["position"]) == caps.positions and list(r["token_id"]) == ids
    assert list(r["token"]) == [tok.decode([t]) for t in ids]
    assert (r["layer"] == 7).all() and df[df["site"] == "logits"]["layer"].isna().all()
    a = caps.arrays["residual.7"].astype(np.float64)
    np.testing.assert_allclose(r["norm"], np.sqrt((a * a).sum(-1)), rtol=1e-5)
    np.testing.assert_allclose(r["mean"], a.mean(-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(r["std"], a.std(-1), rtol=1e-4)
    np.testing.assert_allclose(r["max_abs"], np.abs(a).max(-1), rtol=1e-6)
    with_vectors = captures_frame(caps, vectors=True)
    assert with_vectors["token"].isna().all()
    np.testing.assert_array_equal(
        np.stack(with_vectors[with_vectors["site"] == "residual.7"]["vector"]), a.astype(np.float32)
    )


def test_top_tokens_frame_is_the_lens_top_k(llm, lensed):
    _, lens, ids = lensed
    tok = llm.get_tokenizer()
    k = 3
    df = top_tokens_frame(lens, tok, k=k)
    assert len(df) == len(lens.layers) * len(lens.positions) * k
    top, logprobs = lens.top_tokens(k)
    row = df[(df["layer"] == 20) & (df["position"] == 5)].sort_values("rank")
    assert list(row["token_id"]) == list(top[20, 5]) and list(row["token"]) == [
        tok.decode([t]) for t in top[20, 5]
    ]
    assert set(row["input_token"]) == {tok.decode([ids[5]])}
    np.testing.assert_allclose(row["prob"], np.exp(logprobs[20, 5]), rtol=1e-6)
    table = df[df["rank"] == 0].pivot(index="layer", columns="position", values="token_id")
    np.testing.assert_array_equal(table.to_numpy(), top[..., 0])
