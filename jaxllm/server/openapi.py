"""GET /openapi.json: an OpenAPI 3.1 document of the routes, its request schemas generated from the same
pydantic models that validate the bodies (protocol.body_models), so the document cannot drift from what
the server accepts. Responses are described by status only; errors share OpenAI's error object."""

from __future__ import annotations

import functools

from pydantic.json_schema import models_json_schema

from jaxllm.server.protocol import body_models

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
_GET_ROUTES = {
    "/v1/models": "The served model names",
    "/health": "200 while the server is up",
    "/version": "jaxllm's version",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "This document",
}
_SUMMARIES = {
    "/v1/chat/completions": "Create a chat completion (OpenAI's API, with vLLM's extra fields)",
    "/v1/completions": "Create a completion (OpenAI's API, with vLLM's extra fields)",
    "/tokenize": "Token ids of a prompt or of chat messages through the chat template (vLLM's)",
    "/detokenize": "Text of token ids (vLLM's)",
}


def _error_response(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }


@functools.cache
def openapi_document(version: str) -> dict:
    models = body_models()
    refs, top = models_json_schema([(m, "validation") for m in models.values()], ref_template=_REF)
    schemas = dict(top.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR
    paths: dict = {}
    for path, model in models.items():
        paths[path] = {
            "post": {
                "summary": _SUMMARIES[path],
                "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                },
                "responses": {
                    "200": {"description": "The result (a JSON object, or server-sent events with stream)"},
                    "400": _error_response("The request is invalid; `param` names the field"),
                    "404": _error_response("The model is not served"),
                },
            }
        }
    for path, summary in _GET_ROUTES.items():
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxllm OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
