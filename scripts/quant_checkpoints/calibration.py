"""Calibration texts and reference prompts, built from what every Python install carries (no dataset is
downloaded): the Zen of Python (the `this` module, stored rot13-encoded), the interpreter's LICENSE file
where the install has one, and standard-library docstrings. GPTQ and AWQ need real text to measure
activations; the reference prompts are short natural-language and code openings whose greedy
continuations are confident, so that a quantized model's drift shows as logprob changes rather than as
a flip at a near tie.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib
import inspect
import io
import os
import sys
import sysconfig

# Standard-library modules whose docstrings are long English prose (stable across 3.11-3.13).
_DOC_MODULES = ("argparse", "collections", "functools", "json", "logging", "pathlib", "subprocess")

REFERENCE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, there was a little",
    "Beautiful is better than ugly. Explicit is better than",
    "The three primary colors are",
)
NUM_NEW_TOKENS = 16
TOP_K = 5


def zen_of_python() -> str:
    """The Zen text, decoded from `this.s` (importing `this` prints it: the print is swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13")


def _license_text() -> str | None:
    stdlib = sysconfig.get_paths()["stdlib"]
    path = os.path.join(stdlib, "LICENSE.txt")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def calibration_texts(max_chars: int = 600) -> list[str]:
    """A few short texts (each cut to `max_chars`, about 1,000 tokens in all): enough for GPTQ's Hessians
    and AWQ's scale search on a 135M model; AWQ's search time grows with the token count, and it is the
    longest step of the build."""
    texts = [zen_of_python()]
    license_text = _license_text()
    if license_text:
        texts.append(license_text)
    for name in _DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            texts.append(doc)
    return [t[:max_chars] for t in texts]


def calibration_sha256(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
