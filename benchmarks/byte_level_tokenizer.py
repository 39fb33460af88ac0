"""A synthetic byte-level BPE tokenizer of any vocabulary size, for random-weight presets under grammars.

    write_byte_level_tokenizer(dir, vocab_size, bos_id, eos_ids) -> dir (an HF tokenizer folder)

    ids that are not special, in ascending order, take in turn:
      the 256 byte tokens (GPT-2's byte-to-character map, as every byte-level BPE stores them)
      -> JSON_PIECES and WORDS: the structural pieces JSON needs ('{"', '":', '",', 'true', ...), digits,
         whitespace runs and common words, each with its prefixes (so that BPE can merge up to it)
      -> filler word pieces: a letter appended to an earlier word piece, lengths drawn around 5-6
         characters, half of them with a leading space, seeded (the same call gives the same file)
    special tokens (<|begin_of_text|>, <|end_of_text|>, ...) sit at bos_id and eos_ids

The word-level synthetic tokenizer (server_process.write_synthetic_tokenizer) spells no "{" or '"', so
no grammar can build JSON from it. This one can spell any text (every byte is a token), encodes JSON
in multi-character pieces as a real BPE does, and fills the vocabulary with word pieces shaped like a
real one's (a prefix tree of letters, with and without a leading space), so that a grammar engine
walks a token trie of realistic size and shape when it fills a mask. Every token is reachable: each
multi-character token is the merge of its prefix and its last character, and (as in Llama 3's
tokenizer) a pre-token that is a whole token encodes as that token; `decode(encode(text)) == text`.
"""

from __future__ import annotations

import json
import os

import numpy as np

BOS_TEXT = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"

# What JSON documents are made of, as a BPE trained on JSON would have learned it (the GPT-2
# pre-tokenizer splits text into runs of letters, digits, punctuation and spaces; these are such runs).
JSON_PIECES = (
    "{", "}", "[", "]", ":", ",", '"', "{\"", "\"}", "\":", "\",", "\":\"", "\",\"", "\"]", "[\"", "[{",
    "}]", "},", "},{", "}}", "]}", "],", "\":[", "\":{", "\":[{", "\"}]", "\"},", "\"}}", ":\"", ",\"",
    " \"", " {", " [", " }", " ]", "\": \"", "\", \"", "\": ", "\": [", "\": {", "\"},{\"",
    "true", "false", "null", " true", " false", " null", "-", ".", "e", "E", "+", "\\", "\\\"", "\\n",
    "\n", "\n ", "\n  ", "\n    ", "\n      ", "\n        ", "  ", "   ", "    ", "        ", "\t",
    " ", "@", "_", "#", "/", "//", "://", "http", "https", "www", ".com", ".org",
)  # fmt: skip
WORDS = (
    "name", "id", "age", "email", "city", "street", "country", "zip", "code", "title", "type", "value",
    "items", "tags", "status", "price", "count", "score", "date", "time", "description", "address",
    "user", "users", "first", "last", "phone", "number", "active", "enabled", "color", "size", "level",
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "that", "this",
    "John", "Smith", "Alice", "Bob", "London", "Paris", "Berlin", "red", "green", "blue", "small",
    "medium", "large", "open", "closed", "pending", "example", "data", "result", "error", "message",
)  # fmt: skip
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
# English letter frequencies (per mille) for LETTERS, so that filler pieces look like word pieces.
LETTER_WEIGHTS = (127, 91, 82, 75, 70, 67, 63, 61, 60, 43, 40, 28, 28, 24, 24, 22, 20, 20, 19, 15, 10, 8, 2, 2, 1, 1)  # fmt: skip
# Lengths of filler pieces in characters (a leading space counts), weighted around a BPE vocabulary's.
FILLER_LENGTHS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
FILLER_LENGTH_WEIGHTS = (6, 10, 13, 14, 13, 12, 10, 8, 6, 4, 3)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters, which byte-level BPE
    vocabularies (and the `tokenizers` ByteLevel pre-tokenizer and decoder) use: printable Latin-1 bytes
    stand for themselves, the other 68 take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _to_byte_level(text: str, table: dict[int, str]) -> str:
    return "".join(table[b] for b in text.encode("utf-8"))


class _VocabBuilder:
    """Regular tokens in id order, each multi-character one with the merge that makes it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens: list[str] = []
        self.index: set[str] = set()
        self.merges: list[tuple[str, str]] = []

    def full(self) -> bool:
        return len(self.tokens) >= self.capacity

    def add(self, token: str) -> bool:
        """Adds `token` (whose prefix without its last character must be present, or be one character)."""
        if token in self.index or self.full():
            return False
        if len(token) > 1:
            assert token[:-1] in self.index, token
            self.merges.append((token[:-1], token[-1]))
        self.tokens.append(token)
        self.index.add(token)
        return True

    def add_with_prefixes(self, token: str) -> None:
        for end in range(2, len(token) + 1):
            self.add(token[:end])


def byte_level_vocab(num_regular: int, seed: int = 0) -> tuple[list[str], list[tuple[str, str]]]:
    """The regular tokens (in id order, as byte-level strings) and the BPE merges, in rank order."""
    if num_regular < 256:
        raise ValueError(f"a byte-level vocabulary needs >= 256 regular tokens, got {num_regular}")
    table = bytes_to_unicode()
    vocab = _VocabBuilder(num_regular)
    for b in range(256):
        vocab.add(table[b])
    space = table[ord(" ")]
    for piece in JSON_PIECES:
        vocab.add_with_prefixes(_to_byte_level(piece, table))
    for word in WORDS:
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            vocab.add_with_prefixes(_to_byte_level(form, table))
    for n in range(1000):  # numbers up to three digits, with and without a leading space
        vocab.add_with_prefixes(str(n))
        vocab.add_with_prefixes(space + str(n))
    # Word pieces by length: each is an earlier piece one character shorter plus a letter.
    # Lower-case starts three times as often as capitals (a list entry given thrice is drawn thrice as often).
    by_length: dict[int, list[str]] = {1: list(LETTERS * 3 + LETTERS.upper())}
    by_length[2] = [space + c for c in LETTERS * 3 + LETTERS.upper()]
    for t in by_length[2]:
        vocab.add(t)
    rng = np.random.default_rng(seed)
    lengths = np.asarray(FILLER_LENGTHS)
    p_length = np.asarray(FILLER_LENGTH_WEIGHTS, dtype=np.float64) / sum(FILLER_LENGTH_WEIGHTS)
    p_letter = np.asarray(LETTER_WEIGHTS, dtype=np.float64) / sum(LETTER_WEIGHTS)
    misses = 0
    while not vocab.full():
        want = 2 * (num_regular - len(vocab.tokens)) + 64  # drawn in bulk: one draw per token is slow
        drawn_lengths = rng.choice(lengths, size=want, p=p_length)
        drawn_letters = rng.choice(len(LETTERS), size=want, p=p_letter)
        drawn_bases = rng.random(want)
        for length, letter, u in zip(drawn_lengths.tolist(), drawn_letters.tolist(), drawn_bases.tolist()):
            while not by_length.get(length - 1):
                length -= 1
            bases = by_length[length - 1]
            token = bases[int(u * len(bases))] + LETTERS[letter]
            if vocab.add(token):
                by_length.setdefault(length, []).append(token)
                misses = 0
            elif vocab.full():
                break
            else:
                misses += 1
                if misses > 100_000:  # every short piece taken: cannot happen below ~10^9 tokens
                    raise RuntimeError(f"could not fill {num_regular} tokens")
    return vocab.tokens, vocab.merges


def special_tokens(bos_id: int, eos_ids: list[int]) -> dict[int, str]:
    """id -> text of the special tokens: the first end token is <|end_of_text|>, others <|end_N|>."""
    out = {bos_id: BOS_TEXT}
    for k, e in enumerate(eos_ids):
        if e in out:
            raise ValueError(f"eos id {e} is also bos_id or listed twice")
        out[e] = EOS_TEXT if k == 0 else f"<|end_{k}|>"
    return out


def write_byte_level_tokenizer(
    directory: str, vocab_size: int, bos_id: int, eos_ids: int | list[int], seed: int = 0
) -> str:
    """Saves a byte-level BPE tokenizer of exactly `vocab_size` tokens as an HF folder (the encoding of
    text starts with bos, as Llama 3's does). Writes nothing when `directory` already holds this one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    eos_list = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
    if not eos_list:
        raise ValueError("eos_ids must name at least one token")
    for name, value in (("bos_id", bos_id), *(("eos_ids", e) for e in eos_list)):
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}={value} must be in [0, vocab_size={vocab_size})")
    specials = special_tokens(bos_id, eos_list)
    if vocab_size - len(specials) < 256:
        raise ValueError(f"vocab_size={vocab_size} leaves fewer than 256 ids for the byte tokens")
    stamp = os.path.join(directory, "synthetic.json")
    want = {
        "kind": "byte-level",
        "vocab_size": vocab_size,
        "bos_id": bos_id,
        "eos_ids": eos_list,
        "seed": seed,
    }
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return directory
    regular, merges = byte_level_vocab(vocab_size - len(specials), seed)
    regular_ids = (i for i in range(vocab_size) if i not in specials)
    vocab = {tok: i for tok, i in zip(regular, regular_ids, strict=False)}
    vocab.update({text: i for i, text in specials.items()})
    assert len(vocab) == vocab_size
    # ignore_merges, as Llama 3's tokenizer has it: a pre-token that is a whole token stays one (chains of
    # prefix merges alone would split " null" when "nu" merges before " n").
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TEXT} $A", pair=f"{BOS_TEXT} $A {BOS_TEXT} $B", special_tokens=[(BOS_TEXT, bos_id)]
    )
    # Already in the vocabulary at their ids: registering them marks them special without moving them.
    tok.add_special_tokens(
        [AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TEXT, eos_token=EOS_TEXT)
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return directory
