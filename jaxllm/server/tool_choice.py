"""A chat request's `tools` / `tool_choice` / `parallel_tool_calls` -> what the server does (vLLM's rules).

    tool_choice absent: "auto" when tools are given, else "none"
    "none"      plain content (the tools still reach the chat template, as in vLLM)
    "auto"      the output is read by the --tool-call-parser; needs --enable-auto-tool-choice too
    "required"  decoding under a JSON schema: an array (at least one item; at most one without
                parallel_tool_calls) of {"name": <one of the tools>, "parameters": <its parameters>}
    {"type": "function", "function": {"name": N}}   decoding under N's parameters schema; the output
                is N's arguments
So under "required" and a named function the arguments always validate against the function's schema.
They cannot be combined with response_format / structured outputs, which would constrain the same text.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from jaxllm.server.errors import APIError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without parameters takes {}
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(slots=True)
class ToolRequest:
    """The request fields this module reads (ChatRequest's attributes of the same names)."""

    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # None: absent
    parallel_tool_calls: bool = True
    constraint_field: str | None = None  # the field another output constraint came in, if any


def tool_request(req) -> ToolRequest:
    """The tool fields of a parsed chat request (protocol_chat.py has checked their types), and the field
    of the request's other output constraint, if any."""
    return ToolRequest(req.tools, req.tool_choice, req.parallel_tool_calls, req.common.constraint_field)


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] | None  # for the chat template
    function_name: str | None = None  # "named": the function
    schema: dict | None = None  # "required" / "named": the JSON schema the output is decoded under
    parallel_tool_calls: bool = True


def plan_tool_calls(req: ToolRequest, *, auto_tool_choice: bool) -> ToolPlan:
    """`auto_tool_choice`: the server runs with --enable-auto-tool-choice and a --tool-call-parser.

    The fields' shapes were checked where the request was parsed (protocol_chat.py: tool_choice is one of
    the four forms, needs tools unless "none", and a named function is one of them); what is left here
    are the rules that depend on the server's flags and on other fields."""
    tools = req.tools or None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or tools is None:
        return ToolPlan("none", tools, parallel_tool_calls=req.parallel_tool_calls)
    if choice == "auto":
        if not auto_tool_choice:
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolPlan("auto", tools, parallel_tool_calls=req.parallel_tool_calls)
    if req.constraint_field is not None:
        raise APIError(
            f"tool_choice {choice!r} constrains the output to tool calls; it cannot be combined with "
            f"'{req.constraint_field}'",
            param="tool_choice",
        )
    if choice == "required":
        return ToolPlan(
            "required",
            tools,
            schema=required_schema(tools, req.parallel_tool_calls),
            parallel_tool_calls=req.parallel_tool_calls,
        )
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return ToolPlan("named", tools, function_name=name, schema=named_schema(tool))


def named_schema(tool: dict) -> dict:
    """The schema of a named function's output: its parameters (an empty object when it has none)."""
    return copy.deepcopy(tool["function"].get("parameters") or EMPTY_PARAMETERS)


def required_schema(tools: list[dict], parallel_tool_calls: bool) -> dict:
    """The schema of tool_choice "required": [{"name": N, "parameters": <N's parameters>}, ...].

    Each function's parameters move into the array's item schema, so their local references
    (`#/$defs/X`, `#/definitions/X`, `#/properties/...`) would point at the wrong place: definitions are
    moved to the root's `$defs` (renamed "<function>.<name>" where another function took the name
    already), and every other local reference is rewritten to the parameters' new place."""
    variants, defs = [], {}
    for k, tool in enumerate(tools):
        name = tool["function"]["name"]
        params = copy.deepcopy(tool["function"].get("parameters") or EMPTY_PARAMETERS)
        own, renames = {}, {}
        for key in ("$defs", "definitions"):
            for def_name, def_schema in (params.pop(key, None) or {}).items():
                new = def_name
                if new in defs or new in own:
                    new = f"{name}.{def_name}"
                if new in defs or new in own:  # two tools of the same name
                    new = f"{k}.{name}.{def_name}"
                own[new] = def_schema
                renames[f"#/{key}/{_pointer_escape(def_name)}"] = f"#/$defs/{_pointer_escape(new)}"
        here = f"#/items/anyOf/{k}/properties/parameters"
        params = _rewrite_refs(params, renames, here)
        defs.update({n: _rewrite_refs(d, renames, here) for n, d in own.items()})
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _pointer_escape(name: str) -> str:
    """A name as one JSON-pointer segment (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _renamed(ref: str, renames: dict) -> str | None:
    for old, new in renames.items():
        if ref == old or ref.startswith(old + "/"):
            return new + ref[len(old) :]
    return None


def _rewrite_refs(schema: Any, renames: dict, here: str) -> Any:
    """`schema` with its local `$ref`s pointing where their targets now are."""
    if isinstance(schema, list):
        return [_rewrite_refs(v, renames, here) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            moved = _renamed(v, renames)
            out[k] = moved if moved is not None else here + v[1:]
        else:
            out[k] = _rewrite_refs(v, renames, here)
    return out
