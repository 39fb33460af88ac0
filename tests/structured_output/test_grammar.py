"""Grammar compilation (llguidance) on the embedded model's tokenizer: every kind of StructuredOutputsParams
compiles, bad ones fail naming structured_outputs, compiled grammars are cached, and the masks a matcher
fills are what a hand-computed case says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm.sampling_params import StructuredOutputsParams as SO
from jaxllm.structured_output import GrammarCompiler, TokenConstraint, bitmask_width, fill_token_bitmask
from jaxllm.structured_output.grammar import _no_additional_properties
from jaxllm.tokenizer import load_embedded_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_embedded_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, 49152, [tok.eos_token_id])


def _allowed(constraint: TokenConstraint, vocab: int = 49152) -> set[int]:
    mask = np.full((1, bitmask_width(vocab)), -1, np.int32)
    fill_token_bitmask(mask, {0: constraint})
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]).tolist())


def _follow(compiler, params, text: str, tok):
    """A matcher of `params` after consuming `text`'s tokens; asserts each was allowed by the mask."""
    c = TokenConstraint.create(_sp(params), compiler.vocab_size, compiler.compile(params))
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        assert t in _allowed(c), (text, i, tok.decode([t]))
        c.advance(ids[: i + 1])
    return c


def _sp(so):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(structured_outputs=so)


def test_choice_mask_is_the_prefixes_of_the_choices(compiler, tok):
    c = TokenConstraint.create(
        _sp(SO(choice=["Paris", "London"])), 49152, compiler.compile(SO(choice=["Paris", "London"]))
    )
    got = _allowed(c)
    vocab = tok.get_vocab()
    # hand-computed: a token is allowed first iff its text is a non-empty prefix of a choice
    want = {
        i
        for s, i in vocab.items()
        if (text := tok.convert_tokens_to_string([s]))
        and any(ch.startswith(text) for ch in ("Paris", "London"))
    }
    assert got == want and len(want) >= 4
    # after the whole choice only the end of sequence remains
    done = _follow(compiler, SO(choice=["Paris", "London"]), "Paris", tok)
    assert _allowed(done) == {tok.eos_token_id}


def test_json_schema_accepts_its_documents_and_stops(compiler, tok):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    doc = json.dumps({"name": "Ann", "tags": ["a", "b"]})  # ", " and ": " separators, as the grammar writes
    c = _follow(compiler, SO(json=schema), doc, tok)
    assert _allowed(c) == {tok.eos_token_id}
    # the compact form is what disable_any_whitespace asks for
    compact = json.dumps({"name": "Ann", "tags": ["a"]}, separators=(",", ":"))
    c = _follow(compiler, SO(json=schema, disable_any_whitespace=True), compact, tok)
    assert _allowed(c) == {tok.eos_token_id}
    # a key the schema does not have is never allowed
    c = _follow(compiler, SO(json=schema), '{"', tok)
    assert tok.encode("age", add_special_tokens=False)[0] not in _allowed(c)


def test_regex_and_grammars(compiler, tok):
    c = _follow(compiler, SO(regex=r"[0-9]{3}-[0-9]{2}"), "123-45", tok)
    assert _allowed(c) == {tok.eos_token_id}
    gbnf = 'root ::= "yes" | "no"'
    lark = 'start: "yes" | "no"'
    for g in (gbnf, lark):
        c = _follow(compiler, SO(grammar=g), "no", tok)
        assert _allowed(c) == {tok.eos_token_id}
    c = _follow(compiler, SO(json_object=True), '{"a": [1, 2]}', tok)
    assert tok.eos_token_id in _allowed(c)


@pytest.mark.parametrize(
    "params",
    [
        SO(regex="[a-z"),
        SO(grammar="root ::= undefined_rule"),
        SO(json='{"type": "object"'),
        SO(json={"type": 12}),
    ],
)
def test_invalid_grammars_name_structured_outputs(compiler, params):
    with pytest.raises(ValueError, match="structured_outputs"):
        compiler.compile(params)


def test_compiled_grammars_are_cached(compiler, monkeypatch):
    p = SO(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    assert compiler.cached(p) is None
    first = compiler.compile(p)
    assert compiler.cached(SO(json=json.dumps(p.json))) is first  # same grammar text, same entry
    assert compiler.compile(p) is first
    # the same params object again (it travels from the server to the runner): not even its text is rebuilt
    import jaxllm.structured_output.grammar as grammar

    def rebuilt(_):
        raise AssertionError("grammar_text was computed again")

    monkeypatch.setattr(grammar, "grammar_text", rebuilt)
    assert compiler.compile(p) is first and compiler.cached(p) is first


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        SO()


def test_no_additional_properties_is_added_where_unsaid():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "additionalProperties": True}, "b": {"properties": {}}},
    }
    out = _no_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is True
    assert out["properties"]["b"]["additionalProperties"] is False
