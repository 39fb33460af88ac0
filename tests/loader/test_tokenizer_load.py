"""Folders whose tokenizer_config names the generic fast tokenizer load it directly: the same tokenizer
AutoTokenizer gives (ids, text, special tokens, chat template), without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm.testing.tiny_models import CHATML, build_tokenizer
from jaxllm.tokenizer import load_tokenizer, names_generic_fast_tokenizer

TEXTS = ["Hello world", "héllo wörld, naïve café — 世界 🙂", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer().save_pretrained(d)
    return d


def _rename_class(folder, dst, name):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(folder):
        with open(os.path.join(folder, f), "rb") as src, open(os.path.join(dst, f), "wb") as out:
            out.write(src.read())
    cfg_path = os.path.join(dst, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = name
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("name", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_direct_load_matches_auto_tokenizer(folder, tmp_path, name):
    from transformers import AutoTokenizer

    d = _rename_class(folder, str(tmp_path / name), name)
    assert names_generic_fast_tokenizer(d)
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
    assert type(ours) is type(auto)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == auto.encode(text)
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    assert ours.chat_template == auto.chat_template == CHATML
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == auto.apply_chat_template(msgs, tokenize=False)


def test_other_classes_and_broken_configs_go_through_auto_tokenizer(folder, tmp_path):
    assert not names_generic_fast_tokenizer(_rename_class(folder, str(tmp_path / "q"), "Qwen2Tokenizer"))
    broken = _rename_class(folder, str(tmp_path / "b"), "TokenizersBackend")
    with open(os.path.join(broken, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    assert not names_generic_fast_tokenizer(broken)
    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        load_tokenizer(broken)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(folder + "_missing")


def test_direct_load_does_not_import_torch(folder):
    pytest.importorskip("torch")  # only meaningful where AutoTokenizer would import it
    code = (
        "import sys; from jaxllm.tokenizer import load_tokenizer; "
        f"tok = load_tokenizer({folder!r}); assert tok.encode('Hello world'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]
