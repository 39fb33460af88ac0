"""Tokenizer loading (HF folder or GGUF file) and chat templating.

`load_tokenizer(path)` -> a transformers tokenizer (with the chat template the checkpoint carries; GGUF
files keep theirs in `tokenizer.chat_template`). `apply_chat_template(tok, messages)` -> prompt string.
"""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str, chat_template: str | None = None):
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    try:
        if path.endswith(".gguf"):
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
