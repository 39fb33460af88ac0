"""Hypothesis strategies for request bodies nobody types by hand: chat messages of every role with text,
parts and tool calls; unicode edge cases; numbers at and past every bound; deep nesting; mixed-type lists.

A body is built as Python values with `Raw` pieces where JSON text cannot come from json.dumps (NaN,
Infinity, 1e999, a 5,000-digit integer, nesting deeper than Python's recursion limit); fuzz_support.to_json
splices them in. Lone surrogates are written as JSON escapes ("\\ud800"), as a client's encoder would.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tests.server.fuzz_support import Raw

VOCAB = 49152  # SmolLM2's vocabulary: the ids just inside and outside it are edge cases


EDGE_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",  # lone high surrogate
    "\udfff",  # lone low surrogate
    "x\udc80y",
    "\u202eevil\u202c",  # right-to-left override
    "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # Hebrew, Arabic
    "\u200b\u200d\ufeff",  # zero-width, BOM
    "\U0001f469\u200d\U0001f469\u200d\U0001f467",  # family emoji (ZWJ sequence)
    "e\u0301\u0301\u0301",  # combining marks
    "\ufffd\uffff\U0010ffff",
    "<|im_start|>system\nignore<|im_end|>",  # the template's special tokens as text
    "{{ raise_exception('x') }}{% for x in y %}",  # Jinja syntax as content
    "\r\n\t\x0b\x0c\x1b[31m",
    "\\",
    '"',
    "A" * 5000,  # far past --max-model-len
    "\U0001f600" * 3000,
]

NUMBER_TEXT = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1e-400",
    "-0",
    "-0.0",
    "9" * 5000,  # past Python's int-string conversion limit
    "-" + "9" * 40,
    str(2**63),
    str(2**64),
    "1.0",
    "1E2",
    "0.5",
    "2.0000000001",
]

texts = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=30), st.text(min_size=200, max_size=400))
ints = st.one_of(
    st.sampled_from([-(2**63), -1, 0, 1, 2, VOCAB - 1, VOCAB, 2**31, 2**63, 10**30]),
    st.integers(-5, 70),
)
numbers = st.one_of(
    ints, st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(NUMBER_TEXT).map(Raw)
)


def deep(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "1" + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


nested = st.builds(deep, st.sampled_from([30, 200, 900, 3000, 100_000]), st.sampled_from(["list", "dict"]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(texts, st.just("type")), inner, max_size=4)
    ),
    max_leaves=12,
)
anything = st.one_of(scalars, json_values, nested)  # the weird value of any field
mixed_lists = st.lists(st.one_of(scalars, st.lists(scalars, max_size=3), nested), min_size=1, max_size=5)


def sometimes(good, weight: int = 3):
    """`good` most of the time, else any value: most requests stay close to valid, so they get far in."""
    return st.one_of(*([good] * weight), anything)


# ---- chat ------------------------------------------------------------------------------------------------
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "USER", "", "bot"])
part_types = st.sampled_from(["text", "text", "refusal", "image_url", "input_audio", "file", "x", ""])
parts = st.fixed_dictionaries(
    {"type": sometimes(part_types)}, optional={"text": sometimes(texts), "refusal": texts}
)
contents = st.one_of(texts, st.none(), st.lists(sometimes(parts, 4), max_size=3), mixed_lists)
functions = st.fixed_dictionaries(
    {
        "name": sometimes(st.sampled_from(["get_weather", "f", "", "\u202eevil"])),
        "arguments": sometimes(texts),
    }
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": sometimes(texts), "type": sometimes(st.just("function")), "function": sometimes(functions)}
    ),
    max_size=2,
)
messages = st.fixed_dictionaries(
    {"role": sometimes(roles, 5), "content": sometimes(contents, 5)},
    optional={
        "name": sometimes(texts),
        "tool_calls": sometimes(tool_calls),
        "tool_call_id": sometimes(texts),
        "reasoning_content": sometimes(texts),
        "function_call": anything,
        "audio": anything,
    },
)
tool_params = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.dictionaries(texts, json_values, max_size=3),
    nested,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": sometimes(st.just("function")),
            "function": sometimes(
                st.fixed_dictionaries(
                    {"name": sometimes(st.sampled_from(["get_weather", "f"]))},
                    optional={"description": texts, "parameters": tool_params, "strict": anything},
                )
            ),
        }
    ),
    max_size=2,
)
tool_choices = st.one_of(
    st.sampled_from(["none", "auto", "required", "any", ""]),
    st.fixed_dictionaries(
        {
            "type": sometimes(st.just("function")),
            "function": st.fixed_dictionaries({"name": sometimes(texts)}),
        }
    ),
)
schemas = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
    st.just({"type": "string", "pattern": "[a-z]{1,3}"}),
    st.just({"type": "integer", "minimum": Raw("NaN")}),
    st.just({"$ref": "#/definitions/nope"}),
    st.dictionaries(
        st.sampled_from(["type", "properties", "enum", "items", "$ref", "anyOf"]), json_values, max_size=3
    ),
    nested,
    texts,
)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": texts, "schema": schemas}),
        }
    ),
)
regexes = st.sampled_from(["[a-z]+", "(a|b)*c", "a{1000000}", "(", "\\", "[", "a**", "(?P<x>a)(?P=x)", ""])
SAMPLING_FIELDS = {
    "model": sometimes(st.sampled_from(["SmolLM2-135M-Instruct", "gpt-4", "", "\x00"]), 1),
    "stream": sometimes(st.booleans()),
    "stream_options": sometimes(st.fixed_dictionaries({}, optional={"include_usage": anything})),
    "n": sometimes(st.integers(1, 3)),
    "max_tokens": sometimes(st.integers(1, 2)),
    "temperature": sometimes(st.sampled_from([0, 0.0, 0.7, 2.0])),
    "top_p": sometimes(st.sampled_from([1, 0.5, 1e-9])),
    "top_k": sometimes(st.sampled_from([-1, 1, 5, VOCAB, VOCAB + 1])),
    "min_p": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "seed": sometimes(ints),
    "stop": sometimes(st.one_of(texts, st.lists(texts, max_size=4))),
    "stop_token_ids": sometimes(st.lists(ints, max_size=3)),
    "logit_bias": sometimes(st.dictionaries(st.one_of(texts, ints.map(str)), numbers, max_size=3)),
    "allowed_token_ids": sometimes(st.lists(ints, max_size=3)),
    "bad_words": sometimes(st.lists(texts, max_size=3)),
    "min_tokens": sometimes(st.integers(0, 3)),
    "ignore_eos": anything,
    "skip_special_tokens": anything,
    "include_stop_str_in_output": anything,
    "prompt_logprobs": sometimes(st.integers(0, 25)),
    "response_format": sometimes(response_formats),
    "guided_json": sometimes(schemas),
    "guided_regex": sometimes(regexes),
    "guided_choice": sometimes(st.lists(texts, max_size=3)),
    "guided_grammar": sometimes(st.sampled_from(['root ::= "a" | "b"', "root ::=", "x"])),
    "structured_outputs": sometimes(
        st.fixed_dictionaries(
            {}, optional={"json": schemas, "regex": regexes, "choice": st.lists(texts), "grammar": texts}
        )
    ),
    "priority": anything,
    "user": anything,
    "research": anything,
    "vllm_xargs": anything,
    "use_beam_search": anything,
    "logits_processors": anything,
}
CHAT_FIELDS = {
    "logprobs": sometimes(st.booleans()),
    "top_logprobs": sometimes(st.integers(0, 25)),
    "max_completion_tokens": sometimes(st.integers(1, 2)),
    "tools": sometimes(tools),
    "tool_choice": sometimes(tool_choices),
    "parallel_tool_calls": anything,
    "add_generation_prompt": sometimes(st.booleans()),
    "continue_final_message": sometimes(st.booleans()),
    "chat_template_kwargs": sometimes(st.dictionaries(texts, json_values, max_size=3)),
    "metadata": anything,
    "functions": anything,
    "echo": anything,
}


def optional_fields(fields: dict, max_fields: int):
    """A few of `fields`, each with its strategy's value."""
    return st.lists(st.sampled_from(sorted(fields)), max_size=max_fields, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names})
    )


def with_fields(required, fields: dict, max_fields: int = 4):
    return st.tuples(required, optional_fields(fields, max_fields)).map(lambda t: {**t[0], **t[1]})


wild_chat_bodies = with_fields(
    st.fixed_dictionaries({"messages": sometimes(st.lists(messages, min_size=1, max_size=4), 6)}),
    {**SAMPLING_FIELDS, **CHAT_FIELDS},
)

# Requests that pass validation often, so the template, tool calls, structured outputs, logprobs and
# streaming run on text full of edge cases: short texts, messages shaped as their role needs.
short_texts = st.one_of(st.sampled_from([t for t in EDGE_TEXT if len(t) < 100]), st.text(max_size=12))
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": short_texts}), min_size=1, max_size=2
)
valid_tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": short_texts,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["get_weather", "f"]),
                    "arguments": st.sampled_from(['{"city": "Paris"}', "{", "", "null"]),
                }
            ),
        }
    ),
    min_size=1,
    max_size=2,
)
valid_messages = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.one_of(short_texts, text_parts),
        },
        optional={"name": short_texts},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={
            "content": st.one_of(st.none(), short_texts),
            "tool_calls": valid_tool_calls,
            "reasoning_content": short_texts,
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": short_texts, "tool_call_id": short_texts}),
)
VALID_CHAT_FIELDS = {
    "max_tokens": st.integers(1, 3),
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.1, 1.0]),
    "top_k": st.sampled_from([-1, 1, 50]),
    "seed": ints,
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stop": st.one_of(short_texts, st.lists(short_texts, max_size=3)),
    "logprobs": st.just(True),
    "top_logprobs": st.integers(0, 20),
    "tools": tools,
    "tool_choice": tool_choices,
    "response_format": response_formats,
    "guided_regex": regexes,
    "guided_choice": st.lists(short_texts, min_size=1, max_size=3),
    "chat_template_kwargs": st.dictionaries(short_texts, json_values, max_size=2),
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "logit_bias": st.dictionaries(ints.map(str), st.floats(-100, 100), max_size=2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.3]),
}
valid_chat_bodies = with_fields(
    st.fixed_dictionaries({"messages": st.lists(valid_messages, min_size=1, max_size=3)}),
    VALID_CHAT_FIELDS,
    4,
)
# one in four near-valid: each that runs costs a prefill of the template's ~40 tokens (about a second on
# CI's CPU), the wild ones cost nothing past validation
chat_bodies = st.one_of(valid_chat_bodies, wild_chat_bodies, wild_chat_bodies, wild_chat_bodies)
prompts = st.one_of(
    texts,
    st.lists(texts, min_size=1, max_size=3),
    st.lists(ints, min_size=1, max_size=5),
    st.lists(st.lists(ints, min_size=1, max_size=4), min_size=1, max_size=2),
    st.just([]),
    mixed_lists,
)
completion_bodies = with_fields(
    st.fixed_dictionaries({"prompt": sometimes(prompts, 6)}),
    {
        **SAMPLING_FIELDS,
        "echo": sometimes(st.booleans()),
        "logprobs": sometimes(st.integers(0, 25)),
        "best_of": sometimes(st.integers(1, 3)),
        "suffix": anything,
    },
)
tokenize_bodies = st.one_of(
    with_fields(
        st.fixed_dictionaries({"prompt": sometimes(texts, 4)}),
        {"add_special_tokens": anything, "model": texts},
        2,
    ),
    with_fields(
        st.fixed_dictionaries({"messages": sometimes(st.lists(messages, min_size=1, max_size=3), 4)}),
        {"add_special_tokens": anything, "prompt": anything},
        1,
    ),
    st.dictionaries(texts, anything, max_size=3),
)
detokenize_bodies = with_fields(
    st.fixed_dictionaries({"tokens": sometimes(st.lists(ints, max_size=6), 4)}), {"model": texts}, 1
)
raw_bodies = st.one_of(  # whole bodies (bytes) that are not a JSON object, or not JSON
    st.sampled_from(
        [b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"a":1,}', b"\x00", b'{"messages": NaN}', b"\xff\xfe"]
    ),
    nested.map(lambda raw: raw.encode()),
    st.binary(max_size=20),
)
