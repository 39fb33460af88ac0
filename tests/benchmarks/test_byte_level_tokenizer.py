"""The synthetic byte-level tokenizer (benchmarks/byte_level_tokenizer.py): its size and special ids at
the Llama-3.1-8B preset's values, text round trips, the byte map against `tokenizers`' own, and the bytes
each token stands for as a grammar engine (llguidance) reads them, against a brute-force reference."""

from __future__ import annotations

import os

import pytest

from benchmarks.byte_level_tokenizer import (
    BOS_TEXT,
    EOS_TEXT,
    bytes_to_unicode,
    write_byte_level_tokenizer,
)
from jaxllm.models.presets import get_preset

TEXTS = (
    '{"name": "Zoë Ångström", "age": 42, "tags": ["a", "b"], "ok": true, "x": null}',
    "plain words, then\n\ttabs and  double  spaces, digits 1234567 and -3.5e+10",
    "unicode: 日本語 😀 \u0000 \x7f é",
    "",
    " leading space and trailing ",
)


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    from jaxllm.tokenizer import load_tokenizer

    cfg = get_preset("llama-3.1-8b")
    path = write_byte_level_tokenizer(
        str(tmp_path_factory.mktemp("tok")), cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]
    )
    return path, load_tokenizer(path)


def test_size_and_special_ids_match_the_preset(llama_tokenizer):
    _, tok = llama_tokenizer
    assert len(tok) == 128256 and len(set(tok.get_vocab())) == 128256  # every id is one distinct token
    assert sorted(tok.get_vocab().values()) == list(range(128256))
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    assert tok.convert_ids_to_tokens([128000, 128001, 128008, 128009]) == [
        BOS_TEXT,
        EOS_TEXT,
        "<|end_1|>",
        "<|end_2|>",
    ]
    ids = tok.encode("hi")
    assert ids[0] == 128000 and 128000 not in ids[1:]  # the encoding starts with bos, as Llama 3's does


def test_text_round_trips_and_json_pieces_are_single_tokens(llama_tokenizer):
    _, tok = llama_tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_token_id, *ids], skip_special_tokens=True) == text
    # What JSON is made of comes in pieces, not byte by byte (GPT-2's pre-tokenizer splits `{"a":` into
    # `{"`, `a`, `":`): the pieces are one token each.
    for piece in ('{"', '":', '",', '"}', "true", " null", " 42", "\n  "):
        assert len(tok.encode(piece, add_special_tokens=False)) == 1, piece


def test_byte_map_is_the_one_tokenizers_uses():
    from tokenizers import decoders, pre_tokenizers

    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    decoder = decoders.ByteLevel()
    for b in range(128):  # one byte each: ASCII decodes to itself
        assert decoder.decode([table[b]]) == chr(b)
    assert decoder.decode([table[0xC3], table[0xA9]]) == "é"  # two bytes of one UTF-8 character


def test_a_grammar_engine_reads_each_tokens_bytes(llama_tokenizer):
    """llguidance's mask for the choice ("yes" | "no") at the start: exactly the tokens whose bytes are a
    non-empty prefix of one of the words, found here by decoding every token."""
    llguidance = pytest.importorskip("llguidance")
    import numpy as np

    path, tok = llama_tokenizer
    with open(os.path.join(path, "tokenizer.json")) as f:
        ll_tok = llguidance.LLTokenizer(f.read(), n_vocab=len(tok), eos_token=tok.eos_token_id)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_regex("(yes|no)"))
    assert not matcher.is_error(), matcher.get_error()
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = set(np.flatnonzero(np.unpackbits(mask, bitorder="little")[: len(tok)]).tolist())
    expected = set()
    for i in range(len(tok)):
        if i in (128000, 128001, 128008, 128009):
            continue
        text = tok.decode([i])
        if text and ("yes".startswith(text) or "no".startswith(text)):
            expected.add(i)
    assert expected >= {tok.convert_tokens_to_ids(t) for t in ("y", "n", "no")}
    assert allowed == expected


def test_small_vocab_and_validation(tmp_path):
    from jaxllm.tokenizer import load_tokenizer

    path = write_byte_level_tokenizer(str(tmp_path / "tiny"), 512, 1, 2)  # the tiny-llama preset's ids
    tok = load_tokenizer(path)
    assert len(tok) == 512 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    saved = os.stat(os.path.join(path, "tokenizer.json")).st_mtime_ns
    write_byte_level_tokenizer(path, 512, 1, 2)  # the same one: left as it is
    assert os.stat(os.path.join(path, "tokenizer.json")).st_mtime_ns == saved
    for bad, match in (
        ((260, 1, [2, 3, 4, 5, 6]), "fewer than 256"),
        ((512, 512, 2), "bos_id"),
        ((512, 1, [2, 1]), "also bos_id"),
        ((512, 1, []), "at least one"),
    ):
        with pytest.raises(ValueError, match=match):
            write_byte_level_tokenizer(str(tmp_path / "bad"), *bad)
