"""Research on the server: the limits a request is held to, the served model's sizes, and the checks that
need them (protocol_research.py checks, with every other field, what needs neither).

    ResearchParams (from the body), each prompt's length and SamplingParams
        --check_research--> a 400 naming research.capture, research.steer[i].site, research.steer[i].vector
          when a layer or a width does not fit the model, or research.capture when what the request could
          capture exceeds --max-research-capture-bytes; run before the engine sees the request
    CompletionOutput.captures --choice_research--> a choice's `research` (jaxllm.research_wire's format)

The size is bounded before anything runs: positions the request can produce (its prompt and max_tokens,
as capture_positions selects them) x samples x, per site, the hidden size times the model dtype's bytes
(the vocabulary times 4 for f32 logits), summed over the prompts of one HTTP request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from jaxllm.outputs import Captures
from jaxllm.research_params import ResearchParams
from jaxllm.research_wire import encode_captures
from jaxllm.server.errors import APIError, split_field
from jaxllm.server.streaming import RawJSONText

DEFAULT_MAX_CAPTURE_BYTES = 64 << 20
# Captures of this many bytes and more are encoded on a worker thread (choice_research_async).
OFFLOAD_BYTES = 1 << 20
DEFAULT_MAX_SITES = 32
DEFAULT_MAX_STEERS = 8
LOGITS_ITEMSIZE = 4  # logits are captured in f32 whatever the model's dtype


@dataclass(frozen=True, slots=True)
class ResearchLimits:
    """--enable-research-api and the bounds on one request (--max-research-*)."""

    enabled: bool = False
    max_capture_bytes: int = DEFAULT_MAX_CAPTURE_BYTES
    max_sites: int = DEFAULT_MAX_SITES
    max_steers: int = DEFAULT_MAX_STEERS


@dataclass(frozen=True, slots=True)
class ResearchModel:
    """The served model's sizes that research requests are checked against."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    itemsize: int  # bytes of one captured activation: the model's compute dtype
    num_heads: int = 1  # query heads (Scale's head index)


def research_model(engine) -> ResearchModel | None:
    """The sizes of an in-process engine's model; None when it cannot serve research: a model outside the
    Llama family, tensor parallelism or several hosts (the engine checks the same again when
    the request arrives), or an engine that is not jaxllm's."""
    inner = getattr(engine, "engine", None)
    loaded = getattr(inner, "loaded", None)
    if loaded is None or not getattr(loaded.module, "supports_research", False):
        return None
    if getattr(getattr(inner, "tp", None), "mesh", None) is not None or getattr(inner, "step_channel", None):
        return None
    arch = loaded.arch
    return ResearchModel(
        arch.num_layers, arch.hidden_size, arch.vocab_size, loaded.dtype.itemsize, arch.num_heads
    )


def capture_bytes(rp: ResearchParams, prompt_len: int, max_tokens: int, n: int, model: ResearchModel) -> int:
    """The most bytes of activations one prompt's request can capture (all `n` samples)."""
    # a request with P prompt tokens and G generated ones feeds positions 0 .. P + G - 2 to the model
    rows = len(rp.positions(prompt_len, prompt_len + max_tokens - 1))
    per_row = sum(
        model.vocab_size * LOGITS_ITEMSIZE if s.kind == "logits" else model.hidden_size * model.itemsize
        for s in rp.capture_sites
    )
    return n * rows * per_row


def _fits(part: ResearchParams, model: ResearchModel, param: str, strip: str = "") -> None:
    try:
        part.check_model(model.num_layers, model.hidden_size, model.num_heads)
    except ValueError as e:
        name, text = split_field(str(e))
        p = f"{param}.{name.removeprefix(strip)}" if name else param
        raise APIError(f"{p}: {text}", param=p) from None


def check_research(
    rp: ResearchParams,
    field: str,
    requests: list[tuple[int, int, int]],
    model: ResearchModel | None,
    limits: ResearchLimits,
) -> None:
    """`requests`: (prompt length, max_tokens, n) of each engine request the HTTP request makes; `field`:
    where the research object came ("research" or "vllm_xargs.research"). Raises APIError naming the
    field when the model cannot serve it or it could capture more than the server allows."""
    if model is None:
        raise APIError(
            f"{field}: this server's model has no research sites (Llama family, on one device)", param=field
        )
    _fits(ResearchParams(capture=rp.capture), model, field)
    for i, s in enumerate(rp.steer):
        _fits(ResearchParams(steer=(s,)), model, f"{field}.steer[{i}]", strip="steer.")
    for i, s in enumerate(rp.scale):
        _fits(ResearchParams(scale=(s,)), model, f"{field}.scale[{i}]", strip="scale.")
    for i, p in enumerate(rp.patch):
        _fits(ResearchParams(patch=(p,)), model, f"{field}.patch[{i}]", strip="patch.")
    total = sum(capture_bytes(rp, p, m, n, model) for p, m, n in requests)
    if total > limits.max_capture_bytes:
        param = f"{field}.capture"
        raise APIError(
            f"{param}: these sites at these positions could capture {total} bytes; the server allows "
            f"{limits.max_capture_bytes} (--max-research-capture-bytes): capture fewer sites or positions, "
            "or lower max_tokens",
            param=param,
        )


def choice_research(captures: Captures | None, stream: bool) -> dict | None:
    """A choice's `research` (or a streamed chunk's: only when it holds new positions). The base64 goes
    into the response as RawJSONText: written without the JSON encoder scanning it (streaming.py)."""
    if captures is None or (stream and not captures.positions):
        return None
    rs = encode_captures(captures)
    for a in rs["captures"].values():
        a["data"] = RawJSONText(a["data"])
    return rs


async def choice_research_async(captures: Captures | None, stream: bool) -> dict | None:
    """choice_research, on a worker thread for captures of OFFLOAD_BYTES and more (a prompt's captures:
    megabytes): their encoding, mostly numpy loops that release the interpreter lock, then holds neither
    the event loop, which streams the other requests' tokens, nor the engine thread."""
    if captures is not None and sum(a.nbytes for a in captures.arrays.values()) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(choice_research, captures, stream)
    return choice_research(captures, stream)
