"""What the fuzzing (test_fuzz_openapi.py, test_fuzz_messages.py) found answered with a 500, each sent
again as the smallest request that showed it; every one must now be a 400 naming what is wrong, and the
server must keep serving."""

from __future__ import annotations

import pytest

from tests.server.test_errors import _err

# JSON allows these, Python's json.loads raises a plain ValueError on the first (past its 4,300-digit
# int conversion limit), and the tokenizer a TypeError on the lone surrogates.
HUGE_INT = b'{"messages": ' + b"9" * 5000 + b"}"


def test_integer_past_the_digit_limit(client):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        e = _err(client.post(path, content=HUGE_INT), 400, contains="4300 digits")
        assert e["code"] == "invalid_json"


@pytest.mark.parametrize(
    "path,content,param",
    [
        ("/v1/completions", rb'{"prompt": "a\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["ok", "\udfff"], "max_tokens": 1}', "prompt[1]"),
        ("/tokenize", rb'{"prompt": "x\udc80y"}', "prompt"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "\ud800": 1}', None),
    ],
)
def test_lone_surrogate_escape(client, path, content, param):
    e = _err(client.post(path, content=content), 400, contains="lone UTF-16 surrogate")
    assert e["param"] == param


def test_escaped_surrogate_pair_is_text(client):
    # the two halves of one emoji, as an ensure_ascii encoder writes it: one character, accepted
    r = client.post("/tokenize", content=rb'{"prompt": "\ud83d\ude00"}')
    assert r.status_code == 200, r.text
    direct = client.post("/tokenize", json={"prompt": "\U0001f600"})
    assert r.json()["tokens"] == direct.json()["tokens"]
