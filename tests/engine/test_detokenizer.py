"""Incremental detokenizer and stop strings against `tokenizer.decode` of the whole output, with a
byte-level BPE trained here (multi-byte characters split over several tokens) and the embedded model's
GGUF tokenizer."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxllm.engine.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    rust_decoder,
    stop_holdback_len,
)

CORPUS = [
    "héllo 世界 🙂 hello world, the quick brown fox jumps over the lazy dog.",
    "ünïcödé ça va? 日本語のテキスト and some plain english words again and again.",
]
TEXTS = [
    "héllo 世界 🙂 ok 🙂🙂 done",
    "the quick brown fox 🦊 jumps over the lazy dog 日本語",
    "ça va? ünïcödé — “quotes” 🙂",
]


@pytest.fixture(scope="module")
def bpe():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _stream(tok, prompt_ids, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = [d.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, d.flush(), d


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(bpe, text, chunk):
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # the case under test: split characters
    deltas, rest, d = _stream(bpe, bpe.encode("prompt: "), ids, chunk)
    assert rest == ""
    assert "".join(deltas) == bpe.decode(ids) == text == d.output_text
    assert not any("\ufffd" in x for x in deltas)
    assert d.output_token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(bpe, skip):
    ids = bpe.encode("héllo 🙂") + [bpe.eos_token_id] + bpe.encode(" 世界")
    deltas, rest, _ = _stream(bpe, [bpe.eos_token_id], ids, skip_special_tokens=skip)
    assert "".join(deltas) + rest == bpe.decode(ids, skip_special_tokens=skip)
    assert ("<eos>" in "".join(deltas)) == (not skip)


def test_incomplete_character_is_held_then_flushed(bpe):
    emoji = bpe.encode("🙂")
    assert len(emoji) > 1
    d = IncrementalDetokenizer(bpe, [])
    assert d.step(bpe.encode("ok ")) == "ok "
    assert [d.step([t]) for t in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert d.flush() == bpe.decode(emoji[:-1])  # the partial bytes, as U+FFFD, only at the end
    d2 = IncrementalDetokenizer(bpe, [])
    d2.step(emoji[:-1])
    assert d2.step(emoji[-1:]) == "🙂"


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_decodes_a_small_window(bpe):
    ids = bpe.encode(" ".join(TEXTS) * 4)
    counting = _CountingTokenizer(bpe)
    deltas, rest, _ = _stream(counting, list(range(50)), ids)
    assert "".join(deltas) + rest == bpe.decode(ids)
    assert len(ids) > 200 and counting.longest <= 5 + 8  # context + one character's bytes


def test_check_stop_strings():
    assert check_stop_strings("hello wor", 3, ["world"], False) == (None, "hello wor")
    assert check_stop_strings("hello world!", 3, ["world"], False) == ("world", "hello ")
    assert check_stop_strings("hello world!", 3, ["world"], True) == ("world", "hello world")
    # only matches ending in the new characters count (older ones were seen by earlier calls)
    assert check_stop_strings("world, hello", 5, ["world"], False) == (None, "world, hello")
    # the earliest of several matches wins
    assert check_stop_strings("a STOP b END", 12, ["END", "STOP"], False) == ("STOP", "a ")


def test_stop_holdback_len():
    assert stop_holdback_len("abc wor", ["world"]) == 3
    assert stop_holdback_len("abc", ["world"]) == 0
    assert stop_holdback_len("xx w", ["xyz", "world", "w"]) == 1
    assert stop_holdback_len("aaaa", ["aaaaaa"]) == 4
    assert stop_holdback_len("say wo", ["world", "wow!"]) == 2
    assert stop_holdback_len("world", ["world"]) == 0  # a whole stop string is check_stop_strings' job


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_while_streaming(bpe, include):
    """Like the engine: step, check, stream what cannot be a stop string's beginning."""
    text = "héllo 世界 🙂 the quick brown fox jumps"
    stops = ["界 🙂 the q", "zzz"]
    ids = bpe.encode(text)
    d = IncrementalDetokenizer(bpe, [])
    out, streamed, found = "", [], None
    for t in ids:
        delta = d.step([t])
        out += delta
        found, out = check_stop_strings(out, len(delta), stops, include)
        if found:
            break
        streamed.append(out[: len(out) - stop_holdback_len(out, stops)])
    assert found == "界 🙂 the q"
    assert out == ("héllo 世界 🙂 the q" if include else "héllo 世")
    tokens_of_stop = {bpe.decode([t]) for t in ids} & {"界 🙂 the q"}
    assert not tokens_of_stop  # the stop string is spread over several tokens
    assert all(out.startswith(s) for s in streamed)  # nothing streamed was taken back


def _sentencepiece_style_tokenizer():
    """Metaspace BPE with byte fallback (Llama-2 style): characters outside the vocab become byte tokens."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.train_from_iterator(
        ["hello world, the quick brown fox jumps over the lazy dog ok"] * 10,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]),
    )
    model = json.loads(tk.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = tk.pre_tokenizer
    sp.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_special_tokens(["<unk>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_style_byte_fallback():
    tok = _sentencepiece_style_tokenizer()
    prompt = tok.encode("the quick")
    ids = tok.encode("hello 🙂 world 世界 ok 🙂🙂")
    assert "<0xF0>" in tok.convert_ids_to_tokens(ids)
    deltas, rest, _ = _stream(tok, prompt, ids)
    assert "".join(deltas) + rest == tok.decode(ids) == "hello 🙂 world 世界 ok 🙂🙂"
    assert rest == "" and not any("\ufffd" in x for x in deltas)
    # with prompt context (vLLM's choice) the first token keeps its leading space
    deltas, rest, _ = _stream(tok, prompt, ids, context_tokens=5)
    assert "".join(deltas) + rest == " " + tok.decode(ids)


@pytest.fixture(scope="module")
def gguf_tokenizer():
    from transformers import AutoTokenizer

    from jaxllm.embedded import embedded_model_path

    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_embedded_model_tokenizer(gguf_tokenizer):
    tok = gguf_tokenizer
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("Héllo 世界 🙂! Ça va? 日本語のテキスト 🦊") + [tok.eos_token_id]
    for skip in (True, False):
        deltas, rest, _ = _stream(tok, prompt, ids, skip_special_tokens=skip)
        assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=skip)
        assert rest == "" and not any("\ufffd" in x for x in deltas)


def test_fast_tokenizers_decode_in_rust_and_others_through_decode(bpe, gguf_tokenizer):
    """A transformers fast tokenizer's windows go to its Rust tokenizer (same text as `decode`, above);
    a class with its own `_decode` keeps it, and so does anything without a Rust tokenizer."""
    assert rust_decoder(bpe) is bpe._tokenizer
    assert rust_decoder(gguf_tokenizer) is gguf_tokenizer._tokenizer

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    loud = Shouting(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    assert rust_decoder(loud) is None
    ids = bpe.encode("hello world")
    deltas, rest, _ = _stream(loud, [], ids)
    assert "".join(deltas) + rest == "HELLO WORLD"

    class Plain:  # decode only
        def decode(self, ids, **kwargs):
            return bpe.decode(ids, **kwargs)

    assert rust_decoder(Plain()) is None
    deltas, rest, _ = _stream(Plain(), [], ids)
    assert "".join(deltas) + rest == "hello world"
