"""benchmarks/grammar_cases.py: every example document is accepted by its constraint (jsonschema with
format checks, re.fullmatch, the choice list, Python's own parser for the arithmetic grammar), and
`is_bounded` on hand-made schemas."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from benchmarks.grammar_cases import (
    CHOICE_CASE,
    GRAMMAR_CASE,
    JSON_CASES,
    REGEX_CASE,
    SERVING_SCHEMAS,
    compact,
    is_bounded,
    with_variant,
)


@pytest.mark.parametrize("case", JSON_CASES, ids=lambda c: c.name)
def test_documents_validate_against_their_schemas(case):
    jsonschema.Draft202012Validator.check_schema(case.schema)
    validator = jsonschema.Draft202012Validator(case.schema, format_checker=jsonschema.FormatChecker())
    validator.validate(case.document)
    assert json.loads(compact(case.document)) == case.document
    assert_keys_in_schema_order(case.schema, case.document, case.schema)
    variant = with_variant(case.schema, "x")
    assert variant != case.schema and variant["title"] == "variant-x" and "title" not in case.schema
    jsonschema.Draft202012Validator(variant).validate(case.document)


def assert_keys_in_schema_order(schema, doc, root):
    """Grammar engines emit an object's properties in the schema's order: a document in another order is
    one no engine would produce (and refuses token by token)."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    for alt in schema.get("anyOf", []):
        if jsonschema.Draft202012Validator(alt).is_valid(doc):
            schema = alt
    if isinstance(doc, dict):
        order = list(schema["properties"])
        assert list(doc) == sorted(doc, key=order.index), (list(doc), order)
        for k, v in doc.items():
            assert_keys_in_schema_order(schema["properties"][k], v, root)
    elif isinstance(doc, list):
        for v in doc:
            assert_keys_in_schema_order(schema.get("items", {}), v, root)


def test_schemas_reject_what_they_should():
    by_name = {c.name: c for c in JSON_CASES}
    bad = {
        "person": {**by_name["person"].document, "age": 151},
        "order": {**by_name["order"].document, "order_id": "ORD-12"},
        "ticket": {**by_name["ticket"].document, "status": "new"},
        "tool_call": {**by_name["tool_call"].document, "extra": 1},
        "address": {**by_name["address"].document, "zip": "4900"},
    }
    for name, doc in bad.items():
        validator = jsonschema.Draft202012Validator(
            by_name[name].schema, format_checker=jsonschema.FormatChecker()
        )
        assert not validator.is_valid(doc), name


def test_regex_choice_and_grammar_documents():
    pattern, text = REGEX_CASE
    assert re.fullmatch(pattern, text)
    choices, text = CHOICE_CASE
    assert text in choices and len(set(choices)) == len(choices)
    grammar, text = GRAMMAR_CASE
    assert grammar.startswith("root ::=")
    assert set(text) <= set("0123456789+-*/()") and isinstance(ast.parse(text, mode="eval").body, ast.BinOp)


def test_is_bounded():
    assert [c.name for c in SERVING_SCHEMAS] == [
        "person", "order", "ticket", "event", "payment", "tags", "tool_call", "classification",
    ]  # fmt: skip
    s = {"type": "string"}
    obj = {"type": "object", "additionalProperties": False}
    assert (
        not is_bounded(s) and is_bounded({**s, "maxLength": 3}) and is_bounded({**s, "pattern": "^a{2,5}$"})
    )
    assert not is_bounded({**s, "pattern": "^a+$"}) and not is_bounded({**s, "pattern": "^a{2,}$"})
    assert not is_bounded({**s, "maxLength": 9, "format": "email"})
    assert not is_bounded({"type": "number", "minimum": 0, "maximum": 1})
    assert is_bounded({"type": "integer", "minimum": 0, "maximum": 9})
    assert not is_bounded({"type": "integer", "minimum": 0})
    assert not is_bounded({"type": "array", "items": {"type": "boolean"}})
    assert is_bounded({"type": "array", "maxItems": 2, "items": {"type": "boolean"}})
    assert not is_bounded({"type": "array", "maxItems": 2})  # items of any type
    assert is_bounded({**obj, "properties": {"a": {"enum": [1, 2]}}})
    assert not is_bounded({"type": "object", "properties": {"a": {"enum": [1, 2]}}})  # more keys may follow
    assert not is_bounded({"anyOf": [{"type": "null"}, s]})
    assert not is_bounded({"$ref": "#/$defs/a"})
