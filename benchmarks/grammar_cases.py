"""The constraints the grammar benchmarks compile and walk: varied JSON schemas, a regex, a choice and a
GBNF grammar, each with a document it accepts.

    JSON_CASES: eleven schemas the way clients write them (nested objects, arrays, enums, numeric bounds,
        strings with patterns and formats, anyOf, $defs with recursion, an OpenAI-style tool call), each
        with an example document (tests/benchmarks/test_grammar_cases.py validates every one with
        jsonschema); SERVING_SCHEMAS: the eight that `is_bounded` accepts (bounded strings, integers and
        arrays, no numbers, no recursion), so that a random-weight model decoding under them closes its
        JSON within a few hundred tokens
    REGEX_CASE, CHOICE_CASE, GRAMMAR_CASE: (constraint, accepted text)
    with_variant(schema, tag): the same schema under another text, which a compile cache keyed by the
        schema sees as new (its "title" changes; no engine constrains on the title)

Documents list their keys in the schema's order: the engines generate properties in that order.
Every object sets additionalProperties false (OpenAI's strict schemas must): otherwise any key may follow,
and a document never has to end.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class JsonCase:
    name: str
    schema: dict[str, Any]
    document: Any  # a JSON value the schema accepts

    @property
    def bounded(self) -> bool:
        return is_bounded(self.schema)


_UNBOUNDED_PATTERN = re.compile(r"[+*]|\{\d+,\}")


def is_bounded(schema: Any) -> bool:
    """Whether every document of `schema` has a bounded length, and a short one: strings need a maxLength,
    an enum/const or a pattern without + * {n,}; integers both bounds; arrays a maxItems; objects no
    additional properties; no numbers (their fraction runs on: under random weights a decoder picks one
    of a thousand digit tokens far more often than the one that ends the number), no $ref (recursion)."""
    if not isinstance(schema, dict):
        return True
    if "$ref" in schema or "$defs" in schema:
        return False
    if "enum" in schema or "const" in schema:
        return True
    if "anyOf" in schema or "oneOf" in schema:
        return all(is_bounded(s) for s in schema.get("anyOf", schema.get("oneOf")))
    kind = schema.get("type")
    if kind == "string":
        pattern = schema.get("pattern")
        if pattern is not None:
            return _UNBOUNDED_PATTERN.search(pattern) is None
        return "maxLength" in schema and "format" not in schema
    if kind == "integer":
        return ("minimum" in schema or "exclusiveMinimum" in schema) and (
            "maximum" in schema or "exclusiveMaximum" in schema
        )
    if kind == "array":
        return "maxItems" in schema and is_bounded(schema.get("items", {"type": "number"}))
    if kind == "object":
        return schema.get("additionalProperties") is False and all(
            is_bounded(s) for s in schema.get("properties", {}).values()
        )
    return kind in ("boolean", "null")


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


_NAME = {"type": "string", "minLength": 1, "maxLength": 40}

JSON_CASES: tuple[JsonCase, ...] = (
    JsonCase(
        "person",
        _obj(
            {
                "name": _NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z0-9._]{1,20}@[a-z0-9]{1,20}\\.(com|org|net)$"},
                "active": {"type": "boolean"},
            }
        ),
        {"name": "Alice Smith", "age": 34, "email": "alice.smith@example.com", "active": True},
    ),
    JsonCase(
        "address",
        _obj(
            {
                "street": {"type": "string", "maxLength": 60},
                "city": _NAME,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "GB", "DE", "FR", "JP", "BR"]},
                "updated": {"type": "string", "format": "date-time"},
                "geo": _obj(
                    {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    }
                ),
            }
        ),
        {
            "street": "12 Main Street",
            "city": "Springfield",
            "zip": "49007",
            "country": "US",
            "updated": "2026-11-30T08:15:00Z",
            "geo": {"lat": 42.1, "lon": -85.6},
        },
    ),  # fmt: skip
    JsonCase(
        "order",
        _obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                            "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        }
                    ),
                },
                "paid": {"type": "boolean"},
            }
        ),
        {
            "order_id": "ORD-004211",
            "items": [
                {"sku": "ABC-1234", "quantity": 2, "unit_price_cents": 1999},
                {"sku": "XYZ-0001", "quantity": 1, "unit_price_cents": 25000},
            ],
            "paid": False,
        },
    ),  # fmt: skip
    JsonCase(
        "ticket",
        _obj(
            {
                "status": {"enum": ["open", "in_progress", "blocked", "resolved", "closed"]},
                "priority": {"type": "integer", "enum": [1, 2, 3, 4]},
                "component": {"type": "string", "enum": ["api", "engine", "scheduler", "kernels", "docs"]},
                "assignee": {"anyOf": [_NAME, {"type": "null"}]},
                "labels": {"type": "array", "maxItems": 4, "items": {"enum": ["bug", "perf", "ux", "infra"]}},
            }
        ),
        {
            "status": "blocked",
            "priority": 2,
            "component": "kernels",
            "assignee": None,
            "labels": ["perf", "bug"],
        },
    ),
    JsonCase(
        "event",
        _obj(
            {
                "title": {"type": "string", "maxLength": 80},
                "start": {
                    "type": "string",
                    "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]Z$",
                },
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendees": {
                    "type": "array",
                    "maxItems": 6,
                    "items": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
                },
                "location": {"type": "string", "maxLength": 60},
            },
            required=["title", "start", "duration_minutes"],
        ),
        {
            "title": "Design review",
            "start": "2026-12-05T14:30Z",
            "duration_minutes": 45,
            "attendees": ["bob@example.org", "carol@example.com"],
        },
    ),  # fmt: skip
    JsonCase(
        "payment",
        _obj(
            {
                "amount_cents": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100000000},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "method": {
                    "anyOf": [
                        _obj(
                            {
                                "kind": {"const": "card"},
                                "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                                "expiry": {"type": "string", "pattern": "^(0[1-9]|1[0-2])/[0-9]{2}$"},
                            }
                        ),
                        _obj(
                            {
                                "kind": {"const": "iban"},
                                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
                            }
                        ),
                    ]
                },
            }
        ),
        {
            "amount_cents": 12950,
            "currency": "EUR",
            "method": {"kind": "iban", "iban": "DE44500105175407324931"},
        },
    ),
    JsonCase(
        "tags",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 6,
                    "items": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,15}$"},
                },
                "scores": {
                    "type": "array",
                    "maxItems": 8,
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "summary": {"type": "string", "maxLength": 120},
            }
        ),
        {"tags": ["jax", "llm-serving", "h100"], "scores": [50, 12, 100], "summary": "Grammar engines."},
    ),
    JsonCase(
        "tool_call",
        _obj(
            {
                "name": {"const": "get_weather"},
                "arguments": _obj(
                    {
                        "location": {"type": "string", "maxLength": 60},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    required=["location"],
                ),
            }
        ),
        {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}},
    ),
    JsonCase(
        "classification",
        _obj(
            {
                "label": {"enum": ["spam", "ham", "phishing", "promotion"]},
                "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                "evidence": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 30}},
                "needs_review": {"type": "boolean"},
            }
        ),
        {
            "label": "phishing",
            "confidence": 87,
            "evidence": ["spoofed sender", "urgent tone"],
            "needs_review": False,
        },
    ),  # fmt: skip
    JsonCase(
        "service_config",
        _obj(
            {
                "server": _obj(
                    {
                        "host": {"type": "string", "maxLength": 64},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": _obj(
                            {
                                "enabled": {"type": "boolean"},
                                "cert_path": {"type": "string", "maxLength": 100},
                            },
                            required=["enabled"],
                        ),
                    }
                ),
                "limits": _obj(
                    {
                        "max_connections": {"type": "integer", "minimum": 1},
                        "timeout_s": {"type": "number", "minimum": 0.1, "maximum": 3600},
                    }
                ),
                "features": {"type": "array", "items": {"enum": ["metrics", "tracing", "auth", "cache"]}},
                "description": {"type": "string"},
                "ratio": {"type": "number", "minimum": 0.1, "maximum": 3600},
            },
            required=["server", "limits"],
        ),
        {
            "server": {
                "host": "0.0.0.0",
                "port": 8000,
                "tls": {"enabled": True, "cert_path": "/etc/ssl/c.pem"},
            },
            "limits": {"max_connections": 1024, "timeout_s": 30.5},
            "features": ["metrics", "auth"],
            "description": 'The serving frontend, with "quotes" and a\nnewline.',
            "ratio": 0.75,
        },
    ),  # fmt: skip
    JsonCase(
        "tree",
        {
            "$defs": {
                "node": _obj(
                    {
                        "label": {"type": "string", "maxLength": 20},
                        "weight": {"type": "integer", "minimum": 0, "maximum": 1000},
                        "children": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/node"}},
                    },
                    required=["label", "children"],
                )
            },
            "$ref": "#/$defs/node",
        },
        {
            "label": "root",
            "weight": 1,
            "children": [
                {"label": "a", "children": [{"label": "a1", "weight": 7, "children": []}]},
                {"label": "b", "weight": 2, "children": []},
            ],
        },
    ),  # fmt: skip
)

SERVING_SCHEMAS: tuple[JsonCase, ...] = tuple(c for c in JSON_CASES if c.bounded)

# (constraint, a text it accepts)
REGEX_CASE = ("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?Z ?(INFO|WARN|ERROR) [a-z ]{1,40}",
              "2026-12-05T14:30:07Z WARN disk almost full")  # fmt: skip
CHOICE_CASE = (["positive", "negative", "neutral", "mixed"], "neutral")
# GBNF (llama.cpp's grammar format): arithmetic over integers, with nested parentheses.
GRAMMAR_CASE = (
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= number | "(" expr ")"\nnumber ::= "-"? [0-9]+\n',
    "(12+7)*3-(4/2)*(-5+100)",
)


def compact(document: Any) -> str:
    """The document as a model writes it with whitespace turned off (no space after : or ,)."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


def with_variant(schema: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same constraint under a new text: a cache keyed by the schema's text must compile it again."""
    out = copy.deepcopy(schema)
    out["title"] = f"variant-{tag}"
    return out
