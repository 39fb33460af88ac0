"""Structured outputs and token rules through the whole engine (tiny random Llama, float32, its byte-level
BPE tokenizer): every constrained output satisfies its grammar (checked with json/jsonschema and re), async
scheduling gives the same tokens as one step at a time (the grammar consumes tokens still in flight), free
requests are unchanged beside constrained ones, and logit_bias / allowed_token_ids / bad_words hold."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams as SO

MAX_MODEL_LEN = 256
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["color", "count", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd){1,3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= "on" | "off"'


def _constraints():
    return [
        (SO(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
        (SO(choice=CHOICES), lambda t: t in CHOICES),
        (SO(grammar=GBNF), lambda t: re.fullmatch(r"\((on|off)(,(on|off))?\)", t) is not None),
        (SO(json_object=True, disable_any_whitespace=True), None),  # may run to max_tokens: checked below
    ]


def _workload(vocab: int, n: int = 30):
    rng = np.random.default_rng(5)
    prompts, params, checks = [], [], []
    kinds = _constraints()
    for i in range(n):
        prompts.append(rng.integers(3, vocab, int(rng.integers(2, 30))).tolist())
        if i % 3 == 2:  # a free neighbour
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True))
            checks.append(None)
            continue
        so, check = kinds[i % len(kinds)]
        greedy = i % 2 == 0
        params.append(
            SamplingParams(temperature=0.0 if greedy else 1.0, seed=i, max_tokens=120, structured_outputs=so)
        )
        checks.append((so, check))
    return prompts, params, checks


def _llm(path, cache_dir, async_scheduling: bool):
    return LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        compilation_cache_dir=cache_dir,
        async_scheduling=async_scheduling,
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, jax_cache_dir):
    return _llm(tiny_llama_dir, jax_cache_dir, False), _llm(tiny_llama_dir, jax_cache_dir, True)


def _generate(llm, prompts, params):
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_outputs_follow_their_grammar_and_async_equals_sync(engines):
    sync_llm, async_llm = engines
    vocab = sync_llm.llm_engine.loaded.arch.vocab_size
    prompts, params, checks = _workload(vocab)
    sync = _generate(sync_llm, prompts, params)
    asyn = _generate(async_llm, prompts, params)
    differ = [i for i in range(len(sync)) if sync[i] != asyn[i]]
    assert not differ, [(sync[i], asyn[i]) for i in differ[:2]]
    for (_ids, text, reason), check in zip(asyn, checks):
        if check is None:
            continue
        so, valid = check
        if valid is None:  # any JSON object: a prefix of one when cut by max_tokens
            if reason == "stop":
                assert isinstance(json.loads(text), dict), text
            else:
                assert text.startswith("{"), text
            continue
        assert reason == "stop", (so.kind, text)
        assert valid(text), (so.kind, text)


def test_free_requests_unchanged_beside_constrained_ones(engines):
    _, llm = engines
    vocab = llm.llm_engine.loaded.arch.vocab_size
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, vocab, 12).tolist() for _ in range(8)]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True) for i in range(8)]
    # the same batch with the odd rows constrained (ignore_eos and the same length: the batch keeps its shape)
    mixed = [
        p
        if i % 2 == 0
        else SamplingParams(
            temperature=0.8, seed=i, max_tokens=10, ignore_eos=True, allowed_token_ids=[5, 6, 7]
        )
        for i, p in enumerate(free)
    ]
    a, b = _generate(llm, prompts, free), _generate(llm, prompts, mixed)
    for i in range(0, 8, 2):
        assert a[i] == b[i], i
    for i in range(1, 8, 2):
        assert set(b[i][0]) <= {5, 6, 7}


def test_logit_bias_allowed_ids_and_bad_words(engines):
    _, llm = engines
    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.loaded.arch.vocab_size
    prompt = [[7, 8, 9, 10]]
    (forced,) = _generate(
        llm, prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, logit_bias={42: 100})
    )
    assert forced[0] == [42] * 6
    (greedy,) = _generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first = greedy[0][0]
    (banned,) = _generate(
        llm, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={first: -100})
    )
    assert first not in banned[0]
    (allowed,) = _generate(
        llm, prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=20, allowed_token_ids=[11, 12])
    )
    assert set(allowed[0]) <= {11, 12}
    # a one-token word pushed up by +100 comes out every time, unless it is a bad word
    word, wid = next(
        (w, i)
        for w, i in sorted(tok.get_vocab().items(), key=lambda x: x[1])
        if w.isascii() and w.isalpha() and len(w) > 2
    )
    assert tok.encode(word, add_special_tokens=False) == [wid]
    pushed = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={wid: 100})
    (yes,) = _generate(llm, prompt, pushed)
    (no,) = _generate(llm, prompt, pushed.clone(bad_words=[word]))
    assert yes[0] == [wid] * 6 and wid not in no[0]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(None, SamplingParams(allowed_token_ids=[vocab]), prompt_token_ids=prompt, use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(
            None, SamplingParams(structured_outputs=SO(regex="(")), prompt_token_ids=prompt, use_tqdm=False
        )


def test_bad_word_of_two_tokens_async_equals_sync(engines):
    """A bad word of two tokens [x, x]: with x pushed up, x never follows x, so greedy alternates x with the
    runner-up; under async scheduling the ban needs the x still in flight, read back from the device."""
    sync_llm, async_llm = engines
    tok = sync_llm.get_tokenizer()
    word, wid = next(
        (w, i)
        for w, i in sorted(tok.get_vocab().items(), key=lambda x: x[1])
        if w.isascii()
        and w.isalpha()
        and len(w) > 2
        and tok.encode(w + w, add_special_tokens=False) == [i, i]
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={wid: 100}, bad_words=[word + word]
    )
    prompt = [[7, 8, 9, 10]]
    (sync,) = _generate(sync_llm, prompt, params)
    (asyn,) = _generate(async_llm, prompt, params)
    assert sync == asyn
    ids = sync[0]
    assert ids[0::2] == [wid] * 6 and wid not in ids[1::2], ids
