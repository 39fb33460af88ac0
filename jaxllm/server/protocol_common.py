"""What every request body has in common: the pydantic base, the one place a ValidationError becomes an
OpenAI-shaped 400, and the sampling and structured-output fields both generation routes take.

    JSON body (dict) --validate_body(Model, body, max_logprobs)--> Model instance
        types, ranges and checks across fields: pydantic (strict: "1" is not a number, true is not 1);
        the first error -> APIError(param="messages[2].role", message="messages[2].role: ...")
        a field a model lists in `unserved` (an OpenAI or vLLM field jaxllm does not serve) -> 400 naming it
        any other unknown field -> accepted, named in ONE warning log line (vLLM's behaviour)

Ranges: OpenAI's documented ones for OpenAI's fields; vLLM's extras (top_k, min_p, repetition_penalty, ...)
keep SamplingParams' rules, which the engine checks again for offline users. Checks that need the server's
settings (max_logprobs) read them from the validation context; checks against the vocabulary happen where
the vocabulary is known (generation.make_sampling_params).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.server.errors import APIError

logger = logging.getLogger("jaxllm.server")

MAX_N = 128  # samples per prompt; more is almost certainly a mistake and would flood the engine
# Stop strings: every new piece of text is searched for each of them, so their number and length bound the
# detokenizer's work per token. OpenAI allows 4; these leave room for vLLM users' longer lists.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs' default (vLLM's)
F32_MAX = 3.4e38  # the sampler computes in float32: a larger value would become inf there

NonNegInt = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class FieldError(ValueError):
    """A check that spans fields, raised inside a model validator: `param` is the field's path relative to
    the model that raised it ("tool_choice", "json_schema.schema"); the error's location is prefixed."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class RequestModel(BaseModel):
    """Base of every request object. `unserved` maps a field jaxllm refuses to why (and the values that
    mean "off", which pass): such fields are not declared, so they stay out of /openapi.json. `no_effect`
    names declared fields that are accepted and change nothing in the output (docs/openai_api.md)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    unserved: ClassVar[dict[str, tuple[str, tuple]]] = {}
    no_effect: ClassVar[tuple[str, ...]] = ()


# ---- ValidationError -> APIError -------------------------------------------------------------------------
_BUILTIN_LABELS = {"str", "int", "float", "bool", "dict", "list", "none", "any"}


def _model_names() -> set[str]:
    names, todo = set(), [RequestModel]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _is_union_label(seg: Any, models: set[str]) -> bool:
    """pydantic names the member of a union an error came from inside its location ('str', 'list[str]',
    'ChatMessage'): those are no field names."""
    return isinstance(seg, str) and ("[" in seg or seg in _BUILTIN_LABELS or seg in models)


_WRAPPER = re.compile(r"function-\w+\[[^,\]]*, (.*)\]$")
_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}


def _shape(label: str, models: set[str]) -> str:
    """A union member's label as words: 'list[str]' -> 'a list of strings'."""
    while m := _WRAPPER.match(label):
        label = m.group(1)
    if label in _NAMES:
        return _NAMES[label]
    if label.startswith("literal["):
        return "one of " + label[len("literal[") : -1].replace(",", ", ")
    if label.startswith("list["):
        inner = _shape(label[len("list[") : -1], models)
        return "a list of " + (inner.split(" ", 1)[1] + "s" if " " in inner else inner)
    return "an object" if label.startswith("dict[") or label in models else label


def join_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(err: dict) -> tuple[list, str]:
    """(location without union labels, message) of one pydantic error."""
    models = _model_names()
    loc = [p for p in err["loc"] if not _is_union_label(p, models)]
    exc = (err.get("ctx") or {}).get("error")
    if isinstance(exc, FieldError):
        return loc + [p for p in exc.param.split(".") if p], exc.message
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif err["type"] != "missing":
        msg += f" (got {_short(err['input'])})"
    return loc, msg


def api_error_from_validation(exc: ValidationError) -> APIError:
    """The first error, with its location as the param ("messages[2].role"). An error inside a union
    (`stop`: a string or a list of strings) is reported at the union when the input fits no member's outer
    shape, or inside the one member it fits."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    models = _model_names()
    cut = next((i for i, p in enumerate(first["loc"]) if _is_union_label(p, models)), None)
    if cut is not None:
        prefix = first["loc"][:cut]
        group = [
            e
            for e in errors
            if e["loc"][:cut] == prefix and len(e["loc"]) > cut and _is_union_label(e["loc"][cut], models)
        ]
        deeper = {e["loc"][cut] for e in group if len(e["loc"]) > cut + 1 or e["type"] == "value_error"}
        if len(deeper) == 1:
            first = next(e for e in group if e["loc"][cut] in deeper)
        else:
            shapes = list(dict.fromkeys(_shape(e["loc"][cut], models) for e in group))
            path = join_path([p for p in prefix if not _is_union_label(p, models)])
            text = ", ".join(shapes[:-1]) + (" or " if len(shapes) > 1 else "") + shapes[-1]
            return APIError(f"{path}: {_short(first['input'])} must be {text}", param=path)
    loc, msg = _describe(first)
    path = join_path(loc) or None
    return APIError(f"{path}: {msg}" if path else msg, param=path)


def _extras(model: BaseModel, path: list) -> list[tuple[list, RequestModel, str, Any]]:
    """(path, owner, name, value) of every undeclared field in the tree of validated objects."""
    out = []
    for name, value in (model.model_extra or {}).items():
        out.append((path + [name], model, name, value))
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += _extras(value, path + [name])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, BaseModel):
                    out += _extras(v, path + [name, i])
    return out


def validate_body[M: RequestModel](
    cls: type[M], body: dict, max_logprobs: int = DEFAULT_MAX_LOGPROBS, research_limits=None
) -> M:
    """The request object, or an APIError naming the field. Unknown fields: one warning line.
    `research_limits` (server/research.py; None: research refused) bound the `research` field."""
    context = {"max_logprobs": max_logprobs, "research_limits": research_limits}
    try:
        obj = cls.model_validate(body, context=context)
    except ValidationError as e:
        raise api_error_from_validation(e) from None
    ignored = []
    for path, owner, name, value in _extras(obj, []):
        refused = type(owner).unserved.get(name)
        if refused is None:
            ignored.append(join_path(path))
        elif value is not None and value not in refused[1]:
            p = join_path(path)
            raise APIError(f"{p}: not supported by this server ({refused[0]})", param=p)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
    return obj


def check_logprobs_limit(name: str, value: int | None, context: dict | None) -> int | None:
    limit = (context or {}).get("max_logprobs", DEFAULT_MAX_LOGPROBS)
    if value is not None and value > limit:
        raise ValueError(f"{value} is more than the server allows (--max-logprobs {limit})")
    return value


# ---- structured outputs ------------------------------------------------------------------------------------
def _json_schema_object(value: dict | str, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text -> the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FieldError(param, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise FieldError(param, "must be a JSON schema object")
    return value


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced

    @model_validator(mode="after")
    def _schema_given(self):
        if self.json_schema is None:
            raise FieldError("schema", "is required (the JSON schema the output must follow)")
        return self


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "is required when type is 'json_schema'")
        return self


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsBody(RequestModel):
    """vLLM's `structured_outputs`: exactly one of json (schema), regex, choice, grammar, json_object."""

    unserved: ClassVar = {
        "whitespace_pattern": ("JSON whitespace follows the grammar engine's default", ()),
        "structural_tag": ("structural tags are not served", ()),
    }
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # BaseModel has a .json()
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def _given(self) -> dict[str, Any]:
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        return {
            k: v for k, v in {**values, "json_object": self.json_object}.items() if v not in (None, False)
        }

    @model_validator(mode="after")
    def _exactly_one(self):
        given = list(self._given())
        if len(given) != 1:
            raise FieldError(
                "", f"must set exactly one of {', '.join(STRUCTURED_KINDS)}; got {', '.join(given) or 'none'}"
            )
        if self.json_ is not None:
            self.json_ = _json_schema_object(self.json_, "json")
        return self

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            **self._given(),
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
        )


class StreamOptions(RequestModel):
    unserved: ClassVar = {"continuous_usage_stats": ("usage comes once, in the last chunk", (False,))}
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no effect: no obfuscation padding is sent


# ---- the fields both generation routes take ---------------------------------------------------------------
class SamplingBody(RequestModel):
    """OpenAI's sampling fields, then vLLM's extras. Null means "left out" everywhere."""

    unserved: ClassVar = {
        "guided_whitespace_pattern": ("JSON whitespace follows the grammar engine's default", ()),
        "use_beam_search": ("beam search is not served", (False,)),
        "length_penalty": ("beam search is not served", (1, 1.0)),
        "truncate_prompt_tokens": ("prompts are never truncated", ()),
        "logits_processors": ("custom logits processors are not served", ()),
        "return_tokens_as_token_ids": ("tokens are returned as text", (False,)),
    }
    no_effect: ClassVar = ("user",)
    # OpenAI
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    user: str | None = None  # no effect
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=F32_MAX)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)
    allowed_token_ids: list[NonNegInt] | None = Field(default=None, min_length=1)
    bad_words: list[NonEmptyStr] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    priority: int | None = None
    # jaxllm's: seconds after which the request is aborted (its KV blocks freed) and answered with a 408 or,
    # in a stream, an error event. OpenAI's SDKs' own `timeout=` stays on the client; send this one in
    # extra_body.
    timeout: float | None = Field(default=None, gt=0.0)

    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)
    _structured_field: str | None = PrivateAttr(default=None)  # the field it came in

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_limit(cls, v, info):
        return check_logprobs_limit("prompt_logprobs", v, info.context)

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v):
        strings = [v] if isinstance(v, str) else (v or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(strings)} stop strings is more than the limit of {MAX_STOP_STRINGS}")
        for i, text in enumerate(strings):
            if len(text) > MAX_STOP_STRING_CHARS:
                where = "" if isinstance(v, str) else f"stop[{i}] "
                raise ValueError(
                    f"{where}is {len(text)} characters long, more than the limit of {MAX_STOP_STRING_CHARS}"
                )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} is {bias}; it must be in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _across_fields(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "is only allowed with stream: true")
        if self.stream and self.prompt_logprobs:
            raise FieldError("prompt_logprobs", "is not available with stream: true")
        self._structured = self._structured_outputs()
        return self

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, from whichever field it came in."""
        rf = self.response_format if self.response_format and self.response_format.type != "text" else None
        sources = {
            "response_format": rf,
            "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        given = [k for k, v in sources.items() if v is not None]
        if len(given) > 1:
            raise FieldError(
                ", ".join(given), f"ask for {len(given)} output constraints; a request may give one"
            )
        self._structured_field = given[0] if given else None
        if rf is not None:
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=rf.json_schema.json_schema)
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        if self.guided_json is not None:
            return StructuredOutputsParams(json=_json_schema_object(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        return None

    @property
    def structured(self) -> StructuredOutputsParams | None:
        return self._structured

    @property
    def structured_field(self) -> str | None:
        """The field the output constraint came in (response_format, structured_outputs, guided_*)."""
        return self._structured_field

    def sampling_kwargs(self) -> dict:
        """SamplingParams keyword arguments; OpenAI's defaults for what the client left out."""

        def get(name: str, default: Any) -> Any:
            v = getattr(self, name)
            return default if v is None else v

        return {
            "n": get("n", 1),
            "temperature": get("temperature", 1.0),
            "top_p": get("top_p", 1.0),
            "top_k": get("top_k", -1),
            "min_p": get("min_p", 0.0),
            "presence_penalty": get("presence_penalty", 0.0),
            "frequency_penalty": get("frequency_penalty", 0.0),
            "repetition_penalty": get("repetition_penalty", 1.0),
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": get("ignore_eos", False),
            "min_tokens": get("min_tokens", 0),
            "skip_special_tokens": get("skip_special_tokens", True),
            "spaces_between_special_tokens": get("spaces_between_special_tokens", True),
            "include_stop_str_in_output": get("include_stop_str_in_output", False),
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "allowed_token_ids": list(self.allowed_token_ids) if self.allowed_token_ids else None,
            "bad_words": list(self.bad_words) if self.bad_words else None,
            "structured_outputs": self._structured,
        }
