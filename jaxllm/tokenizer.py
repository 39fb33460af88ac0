"""Tokenizer loading (HF folder or GGUF file) and chat templating.

`load_tokenizer(path)` -> a transformers tokenizer (with the chat template the checkpoint carries; GGUF
files keep theirs in `tokenizer.chat_template`). `apply_chat_template(tok, messages)` -> prompt string.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

# The class names of the generic fast tokenizer (transformers 4 and 5), which is built from tokenizer.json
# alone. A folder that names it loads through that class directly: AutoTokenizer would pick the same
# class, but importing it pulls in the model configuration modules and, with them, torch (10 s of a
# server's start on a GPU machine).
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def names_generic_fast_tokenizer(path: str) -> bool:
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(config)):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class") in GENERIC_FAST_CLASSES
    except (OSError, ValueError, AttributeError):
        return False  # AutoTokenizer then reports what is wrong with the folder


# The embedded model's tokenizer, converted once by transformers from the embedded GGUF file
# (tests/loader/test_embedded_tokenizer.py proves it equal to transformers' own load of that file):
# transformers reads a GGUF's tokenizer through its GGUF reader, which imports torch, and serving the
# embedded model must not need torch.
EMBEDDED_TOKENIZER = os.path.join(os.path.dirname(__file__), "data", "embedded_tokenizer.json.gz")


def load_embedded_tokenizer():
    """The embedded SmolLM2-135M-Instruct's tokenizer from the converted copy jaxllm ships."""
    import gzip

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    with gzip.open(EMBEDDED_TOKENIZER, "rt", encoding="utf-8") as f:
        payload = json.load(f)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(payload["tokenizer"]),
        chat_template=payload["chat_template"],
        **payload["special_tokens"],
    )


def load_tokenizer(path: str, chat_template: str | None = None):
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    try:
        from jaxllm.embedded import is_embedded_model

        if is_embedded_model(path):
            tok = load_embedded_tokenizer()
        elif names_generic_fast_tokenizer(path):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            if path.endswith(".gguf"):
                if importlib.util.find_spec("torch") is None:
                    raise ValueError(
                        "transformers reads a GGUF file's tokenizer through torch, which is not installed: "
                        "install torch, or pass --tokenizer with the model's tokenizer folder"
                    )
                tok = AutoTokenizer.from_pretrained(
                    os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
                )
            else:
                tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError/TypeError by case
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None
    if chat_template is not None:
        if os.path.isfile(chat_template):  # vLLM's --chat-template takes a file or the template itself
            with open(chat_template) as f:
                chat_template = f.read()
        tok.chat_template = chat_template
    return tok


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; pass one with --chat-template or use completions"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
