"""Tool-call parsers on hand-written outputs of each family: the calls and content are the hand-computed
ones, and a stream fed the same text in any split (every cut point, 1-, 2- and 3-character deltas at
every phase, random splits) reassembles to exactly the whole-text result, with deltas shaped as OpenAI
streams them. The incremental JSON scanner under them agrees with `json.loads`."""

from __future__ import annotations

import json
import random
import re

import pytest

from jaxllm.server.tool_parsers import TOOL_PARSERS
from jaxllm.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from jaxllm.server.tool_parsers.json_scanner import JsonScanner

# --- the JSON scanner against json.loads -------------------------------------------------------------


def _loads_strict(text: str):
    def no_constants(name):
        raise ValueError(name)

    return json.loads(text, parse_constant=no_constants)


def _is_json(text: str) -> bool:
    try:
        _loads_strict(text)
        return True
    except ValueError:
        return False


def _scan(text: str, piece: int = 0) -> JsonScanner:
    """The scanner after `text` (leading/trailing whitespace stripped, as json.loads allows it), fed in
    pieces of `piece` characters (0: at once)."""
    text = text.strip(" \t\n\r")
    s = JsonScanner()
    pieces = [text] if not piece else [text[i : i + piece] for i in range(0, len(text), piece)]
    consumed = 0
    for p in pieces:
        n = s.feed(p)
        consumed += n
        if n < len(p):
            break
    s.end()
    s.consumed_all = consumed == len(text)
    return s


JSON_TEXTS = [
    '{"a": 1, "b": [1, 2.5e-3, -0, true, false, null, "x\\u00e9\\n\\"\\\\\\/"], "c": {"d": {}}}',
    "[]",
    "{}",
    '"s"',
    "12",
    "-0.5E+10",
    ' {"a" : { "b" : [ 1 , 2 ] } , "e": "} ] ,"} ',
    '{"k": "caf\u00e9 \u4e2d\u6587 \U0001f600"}',
    "-",
    "01",
    "1.",
    ".5",
    "1e",
    "-1.5e+",
    '{"a" 1}',
    '{"a":1,}',
    "[1,]",
    "[,1]",
    "tru",
    "nulll",
    "True",
    '{"a":"\x01"}',
    '"\\x"',
    '"\\u12G4"',
    "[1 2]",
    '{"a":1}}',
    "{1:2}",
    "{'a': 1}",
    "NaN",
    "[Infinity]",
    "[-]",
    '{"a": [1, {"b": null}]',
    '"unterminated',
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_json_scanner_accepts_exactly_what_json_loads_accepts(text):
    for piece in (0, 1, 2, 3):
        s = _scan(text, piece)
        assert (s.done and s.consumed_all and not s.error) == _is_json(text), (text, piece)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -3, 17, 2.5, -1e-7, 1e21])
    if kind == 1:
        return "".join(rng.choice('ab "\\/\n\té中😀{}[],:') for _ in range(rng.randrange(6)))
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind in (4, 5):
        return {f"k{i}{rng.choice('"xy')}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _random_spacing(rng: random.Random, text: str) -> str:
    """`text` (compact JSON) with whitespace added between tokens (outside strings)."""
    out, in_string, escaped = [], False, False
    for ch in text:
        out.append(ch)
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in ",:[{" and rng.random() < 0.5:
            out.append(rng.choice([" ", "\n", "\t", "  ", "\r\n"]))
    return "".join(out)


def test_json_scanner_on_random_documents_and_their_mutations():
    rng = random.Random(0)
    for _ in range(400):
        value = _random_value(rng)
        text = _random_spacing(rng, json.dumps(value, ensure_ascii=rng.random() < 0.5))
        s = _scan(text, rng.choice([0, 1, 2, 5]))
        assert s.done and s.consumed_all, text
        if isinstance(value, dict):  # member spans hold each member's value
            assert {k: _loads_strict(s.text[a:b]) for k, a, b in s.members} == value
        # One character deleted, replaced or inserted: valid exactly when json.loads says so.
        i = rng.randrange(len(text))
        mutated = rng.choice(
            [
                text[:i] + text[i + 1 :],
                text[:i] + rng.choice('{}[],:"0a\\ ') + text[i + 1 :],
                text[:i] + "x" + text[i:],
            ]
        )
        m = _scan(mutated, rng.choice([0, 1, 3]))
        assert (m.done and m.consumed_all and not m.error) == _is_json(mutated), mutated


def test_json_scanner_never_consumes_past_the_value_or_a_fault():
    s = JsonScanner()
    assert s.feed('{"a": [1, 2]} tail') == len('{"a": [1, 2]}') and s.done
    s = JsonScanner()
    assert s.feed('{"a": [1, 2}') == len('{"a": [1, 2') and s.error and not s.done


# --- the families ------------------------------------------------------------------------------------

WEATHER = {"city": "Paris", "units": "celsius", "days": [1, 2], "note": 'a "quoted" \\ <tool_call> }'}
WEATHER_JSON = json.dumps(WEATHER)

# (parser, output, expected content, expected [(name, arguments as an object)])
CASES = [
    # hermes / qwen
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", "", "", []),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_JSON}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n',
        "Let me check both.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "id": 7, "arguments": {"x": [1, {"y": null}]}, "extra": "ignored"}</tool_call>'
        " and afterwards text",
        "and afterwards text",
        [("f", {"x": [1, {"y": None}]})],
    ),
    (  # a block without its end marker at the end of the output
        "hermes",
        'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',
        "ok",
        [("f", {"a": 1})],
    ),
    (  # not JSON inside the markers: left as content, the next block still counts
        "hermes",
        "<tool_call>\nnot json\n</tool_call> then <tool_call>\n"
        '{"name": "g", "arguments": {"k": "v"}}\n</tool_call>',
        "<tool_call>\nnot json\n</tool_call> then",
        [("g", {"k": "v"})],
    ),
    (  # arguments that are not an object, a name that is not a string, no name: content
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>\n<tool_call>{"name": 5, "arguments": {}}'
        '</tool_call> <tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>\n<tool_call>{"name": 5, "arguments": {}}'
        '</tool_call> <tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    ("hermes", "a <tool_cal b <tool_call", "a <tool_cal b <tool_call", []),
    (
        "qwen",
        '<tool_call>\n{"name": "search", "arguments": {"q": "日本語 😀"}}\n</tool_call>',
        None,
        [("search", {"q": "日本語 😀"})],
    ),
    # llama3_json
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        f' {{"name": "a", "parameters": {WEATHER_JSON}}}; {{"type": "function", "name": "b", "arguments": {{}}}}',
        None,
        [("a", WEATHER), ("b", {})],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", "<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}}\n\nI called f.',
        "I called f.",
        [("f", {"a": 1})],
    ),
    (  # the second item is no call: the first stands, the rest is content
        "llama3_json",
        '{"name": "f", "parameters": {}}; {"nome": "g"}',
        '; {"nome": "g"}',
        [("f", {})],
    ),
    # mistral
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + WEATHER_JSON
        + '}, {"name": "get_time", "arguments": {}}]',
        "Sure.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("mistral", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    ("mistral", "x [TOOL_CALLS][]", "x [TOOL_CALLS][]", []),
    (  # a section with no valid call is content, and the text after its marker is read again
        "mistral",
        '[TOOL_CALLS][{"name": 3}] [TOOL_CALLS]f[ARGS]{"a": [1]}',
        '[TOOL_CALLS][{"name": 3}]',
        [("f", {"a": [1]})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"bad": 1}]',
        ', {"bad": 1}]',
        [("f", {})],
    ),
    ("mistral", "[TOOL_CALL [TOOL", "[TOOL_CALL [TOOL", []),
]

ID_PATTERNS = {"mistral": r"[A-Za-z0-9]{9}"}


def _splits(text: str) -> list[list[str]]:
    """Every cut into two deltas; 1-, 2- and 3-character deltas at every phase; some random splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for k in (1, 2, 3):
        for phase in range(k):
            first = [text[:phase]] if phase else []
            out.append(first + [text[i : i + k] for i in range(phase, len(text), k)])
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
            if len(text) > 1
            else []
        )
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def stream_through(parser, pieces: list[str], id_pattern: str = r"call_[0-9a-f]{24}"):
    """Feeds the pieces, checks every delta's shape, returns (content, [(id, name, arguments)])."""
    content, calls = "", {}
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += d.content
        seen = set()
        for tc in d.tool_calls:
            i = tc["index"]
            assert i not in seen, "one delta per call per chunk"
            seen.add(i)
            if i not in calls:
                assert i == len(calls), "calls are numbered 0, 1, ... in order"
                assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
                assert re.fullmatch(id_pattern, tc["id"]), tc["id"]
                assert set(tc["function"]) == {"name", "arguments"}
                calls[i] = [tc["id"], tc["function"]["name"], tc["function"]["arguments"]]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["function"]["arguments"], "no empty argument deltas"
                calls[i][2] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_parser_on_a_whole_output(family, text, content, calls):
    got = TOOL_PARSERS[family].extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert len({c.id for c in got.calls}) == len(got.calls)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_parser_streamed_in_any_split_equals_the_whole_output(family, text, content, calls):
    cls = TOOL_PARSERS[family]
    whole = cls.extract(text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    for pieces in _splits(text):
        got_content, got_calls = stream_through(cls(), pieces, ID_PATTERNS.get(family, r"call_[0-9a-f]{24}"))
        got = ((got_content or None) if got_calls else got_content, [(n, a) for _, n, a in got_calls])
        assert got == expected, pieces


def test_a_stream_sends_arguments_as_they_are_written():
    """The call goes out once its name is complete and its arguments have opened; then the arguments
    follow piece by piece, and text before a marker is released before the call is known."""
    p = TOOL_PARSERS["hermes"]()
    assert p.feed("Checking").content == "Checking"
    assert p.feed(" now.\n<tool_").content == " now."  # the whitespace and the partial marker wait
    d = p.feed('call>\n{"name": "get_wea')
    assert d.content == "" and d.tool_calls == []
    d = p.feed('ther", "arguments": {"ci')
    assert d.content == ""
    (first,) = d.tool_calls
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert p.feed('ty": "Par').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Par'}}]
    d = p.feed('is"}}\n</tool_call>\n\nDone.')
    assert d.tool_calls == [{"index": 0, "function": {"arguments": 'is"}'}}] and d.content == "Done."
    assert not p.finish()
    assert [c.arguments for c in p.calls] == ['{"city": "Paris"}']


# When a call breaks after its name went out, a stream keeps what it sent (it cannot take it back) and
# sends the rest as content; the whole text leaves that call's text as content. Hand-computed both ways.
BROKEN_AFTER_THE_NAME = [
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call> after',
        ("}}\n</tool_call> after", [("f", '{"a": ')]),
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call> after',
    ),
    (  # cut by max_tokens inside the arguments
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": "long',
        ("", [("f", '{"a": "long')]),
        '<tool_call>\n{"name": "f", "arguments": {"a": "long',
    ),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1,, "b": 2}}',
        (', "b": 2}}', [("f", '{"a": 1,')]),
        '{"name": "f", "parameters": {"a": 1,, "b": 2}}',
    ),
    (
        "mistral",
        '[TOOL_CALLS]f[ARGS]{"a": tru}',
        ("}", [("f", '{"a": tru')]),
        '[TOOL_CALLS]f[ARGS]{"a": tru}',
    ),
]


@pytest.mark.parametrize("family,text,streamed,whole", BROKEN_AFTER_THE_NAME)
def test_a_call_that_breaks_after_its_name_went_out(family, text, streamed, whole):
    cls = TOOL_PARSERS[family]
    got = cls.extract(text)
    assert (got.content, got.calls) == (whole, [])
    for pieces in _splits(text):
        content, calls = stream_through(cls(), pieces, ID_PATTERNS.get(family, r"call_[0-9a-f]{24}"))
        assert (content, [(n, a) for _, n, a in calls]) == streamed, pieces


# --- the forced modes ----------------------------------------------------------------------------------

REQUIRED_CASES = [
    (
        '[{"name": "get_weather", "parameters": ' + WEATHER_JSON + '}, {"name": "t", "parameters": {}}]',
        None,
        [("get_weather", WEATHER), ("t", {})],
    ),
    ('\n[ {"parameters": {"a": 1}, "name": "f"} ]\n', None, [("f", {"a": 1})]),
    ('[{"name": "f", "parameters": {"a": [1, 2', '[{"name": "f", "parameters": {"a": [1, 2', []),  # cut short
    ("not json", "not json", []),
    ("[]", "[]", []),
]


@pytest.mark.parametrize("text,content,calls", REQUIRED_CASES)
def test_required_output(text, content, calls):
    got = RequiredToolParser.extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    if text.rstrip().endswith("]"):  # complete: any split streams to the same result
        expected = (got.content, [(c.name, c.arguments) for c in got.calls])
        for pieces in _splits(text):
            c, tcs = stream_through(RequiredToolParser(), pieces)
            assert (((c or None) if tcs else c), [(n, a) for _, n, a in tcs]) == expected, pieces


def test_named_output_is_the_arguments():
    p = NamedToolParser("get_weather")
    first = p.feed('{"city"')
    assert len(first) == 1 and first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert re.fullmatch(r"call_[0-9a-f]{24}", first[0]["id"]) and first[0]["type"] == "function"
    assert p.feed(': "Paris"}') == [{"index": 0, "function": {"arguments": ': "Paris"}'}}]
    assert p.feed("") == [] and p.finish() == []
    assert json.loads(p.call.arguments) == {"city": "Paris"}
    empty = NamedToolParser("f")
    (d,) = empty.finish()
    assert d["function"] == {"name": "f", "arguments": ""}
