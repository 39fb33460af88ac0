"""The `research` request field (both generation routes): activations to capture and steering to apply.

    {"research": {"capture": ["residual.3", "logits"], "capture_positions": "all",
                  "steer": [{"site": "residual.5", "vector": [...hidden_size numbers], "scale": 4.0}],
                  "scale": [{"site": "attn_out.2", "factor": 0.0, "head": 3}],
                  "patch": [{"site": "residual.4", "position": 7, "vector": [...]}]}}
    or the same object under vLLM's `vllm_xargs`: {"vllm_xargs": {"research": {...}}} (there also as its
    JSON text, since vLLM types vllm_xargs' values as strings, numbers or lists)

    body --ResearchBody--> jaxllm.ResearchParams (its own checks: site names, duplicates, finite vectors)
         --serving (server/research.py)--> checked against the model (layers, hidden size) and the
           server's limits, then SamplingParams(research=...)

Off unless the server runs with --enable-research-api: a request that carries it is then refused naming
the field. What needs no model is checked here, where every field is (errors name `research.capture`,
`research.steer[1].vector`, ...); the number of sites and steers is bounded by the server's flags, read
from the validation context (`research_limits`).
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jaxllm.research_params import Patch, ResearchParams, Scale, Steer
from jaxllm.server.protocol_common import FieldError, RequestModel
from jaxllm.server.research import ResearchLimits, split_field


def engine_field_error(exc: ValueError, strip: str = "") -> FieldError:
    """A ResearchParams/Steer ValueError (its message starts with the field) as a FieldError whose param
    is that field, less the prefix `strip` ("steer." inside one steer)."""
    name, text = split_field(str(exc))
    return FieldError(name.removeprefix(strip), text.removeprefix(strip))


def limits_of(info: ValidationInfo) -> ResearchLimits:
    return (info.context or {}).get("research_limits") or ResearchLimits()


def refuse_if_disabled(value, info: ValidationInfo):
    if value is not None and not limits_of(info).enabled:
        raise ValueError("this server does not serve research (start it with --enable-research-api)")
    return value


class SteerBody(RequestModel):
    """One steering vector: `scale * vector` added at a layer site of every position of the request."""

    site: str
    vector: list[float] = Field(min_length=1)
    scale: float = 1.0

    _steer: Steer | None = None

    @model_validator(mode="after")
    def _as_steer(self):
        try:
            self._steer = Steer(self.site, self.vector, self.scale)
        except ValueError as e:
            raise engine_field_error(e, strip="steer.") from None
        return self

    @property
    def steer(self) -> Steer:
        return self._steer


class ScaleBody(RequestModel):
    """A layer site's activation multiplied by `factor` (0 ablates it); with `head`, one query head's
    share of attn_out before o_proj."""

    site: str
    factor: float = 0.0
    head: int | None = None

    _scale: Scale | None = None

    @model_validator(mode="after")
    def _as_scale(self):
        try:
            self._scale = Scale(self.site, self.factor, self.head)
        except ValueError as e:
            raise engine_field_error(e, strip="scale.") from None
        return self

    @property
    def scale(self) -> Scale:
        return self._scale


class PatchBody(RequestModel):
    """A layer site's activation at one position replaced by `vector` (activation patching)."""

    site: str
    position: int
    vector: list[float] = Field(min_length=1)

    _patch: Patch | None = None

    @model_validator(mode="after")
    def _as_patch(self):
        try:
            self._patch = Patch(self.site, self.position, self.vector)
        except ValueError as e:
            raise engine_field_error(e, strip="patch.") from None
        return self

    @property
    def patch(self) -> Patch:
        return self._patch


class ResearchBody(RequestModel):
    capture: list[str] = Field(default_factory=list)
    capture_positions: Literal["prompt", "generated", "all"] = "all"
    steer: list[SteerBody] = Field(default_factory=list)
    scale: list[ScaleBody] = Field(default_factory=list)
    patch: list[PatchBody] = Field(default_factory=list)

    _params: ResearchParams | None = None

    @field_validator("capture")
    @classmethod
    def _sites_limit(cls, v, info: ValidationInfo):
        limit = limits_of(info).max_sites
        if len(v) > limit:
            raise ValueError(f"{len(v)} sites; the server allows at most {limit} (--max-research-sites)")
        return v

    @field_validator("steer", "scale", "patch")
    @classmethod
    def _steers_limit(cls, v, info: ValidationInfo):
        limit = limits_of(info).max_steers
        if len(v) > limit:
            raise ValueError(f"{len(v)} vectors; the server allows at most {limit} (--max-research-steers)")
        return v

    @model_validator(mode="after")
    def _as_params(self):
        if not (self.capture or self.steer or self.scale or self.patch):
            raise FieldError("", "asks for nothing: give capture (site names), steer, scale or patch")
        try:
            self._params = ResearchParams(
                capture=tuple(self.capture),
                capture_positions=self.capture_positions,
                steer=tuple(s.steer for s in self.steer),
                scale=tuple(s.scale for s in self.scale),
                patch=tuple(p.patch for p in self.patch),
            )
        except ValueError as e:
            raise engine_field_error(e) from None
        return self

    @property
    def params(self) -> ResearchParams:
        return self._params


class VllmXargs(RequestModel):
    """vLLM's `vllm_xargs` (extra arguments for server extensions): jaxllm reads `research` from it; any
    other key is unknown here, accepted and named in the ignored-fields warning."""

    unserved: ClassVar = {}
    research: ResearchBody | None = None

    @field_validator("research", mode="before")
    @classmethod
    def _research(cls, v, info: ValidationInfo):
        if isinstance(v, str):  # vLLM types vllm_xargs' values as strings, numbers or lists
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"is neither an object nor its JSON text ({e})") from None
        return refuse_if_disabled(v, info)


class ResearchFields(RequestModel):
    """The research fields of both generation routes (a base of their bodies beside SamplingBody)."""

    research: ResearchBody | None = None
    vllm_xargs: VllmXargs | None = None

    _research_field: str | None = None

    @field_validator("research", mode="before")
    @classmethod
    def _enabled(cls, v, info: ValidationInfo):
        return refuse_if_disabled(v, info)

    @model_validator(mode="after")
    def _one_research(self):
        given = [
            name
            for name, v in (
                ("research", self.research),
                ("vllm_xargs.research", self.vllm_xargs.research if self.vllm_xargs else None),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise FieldError(", ".join(given), "give research in one of these fields, not both")
        self._research_field = given[0] if given else None
        return self

    @property
    def research_field(self) -> str | None:
        """Where the request's research object came: "research", "vllm_xargs.research" or None."""
        return self._research_field

    @property
    def research_params(self) -> ResearchParams | None:
        if self._research_field is None:
            return None
        body = self.research if self.research is not None else self.vllm_xargs.research
        return body.params
