"""POST /v1/chat/completions: messages -> chat template -> token ids -> one engine request -> OpenAI's shape.

The template is --chat-template when given, else the tokenizer's own; the request's tools reach it, and
earlier tool calls go back through it (tool_messages.py). Streaming sends a first chunk with the assistant
role per choice, then content deltas, the finish reason, and (with stream_options.include_usage) a last
chunk with no choices and the usage. The engine's DELTA outputs (generation.make_sampling_params) carry
exactly what each chunk sends; a single response is the engine's FINAL_ONLY output.

tools / tool_choice (tool_choice.py) decide how the output is read: plain content, or through a tool-call
parser, or decoded under a JSON schema of calls; with --reasoning-parser, <think> text becomes
reasoning_content. chat_output.ChoiceReader does that per choice, whole or per delta. With `research`
(server/research.py) each choice carries its captures beside `message`, a streamed chunk's choice the
positions new in it beside `delta`.
"""

from __future__ import annotations

import time
import uuid

from starlette.responses import Response, StreamingResponse

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.server.chat_output import ChoiceReader, needs_reader
from jaxllm.server.errors import APIError, error_body
from jaxllm.server.generation import (
    ClientDisconnected,
    check_model,
    check_prompt_ids,
    collect,
    deadline_of,
    make_sampling_params,
    merge,
    shielded,
    start_all,
    tracked,
)
from jaxllm.server.logprobs import chat_logprobs, prompt_logprobs_json
from jaxllm.server.protocol import ChatRequest, parse_chat
from jaxllm.server.reasoning import REASONING_PARSERS
from jaxllm.server.research import check_research, choice_research_async
from jaxllm.server.state import ServerState
from jaxllm.server.streaming import DONE, SSE_HEADERS, RawTextJSONResponse, sse
from jaxllm.server.tool_choice import plan_tool_calls, tool_request
from jaxllm.server.tool_messages import template_messages
from jaxllm.server.tool_parsers import TOOL_PARSERS


def render_chat(state: ServerState, req: ChatRequest, tools: list[dict] | None = None) -> list[int]:
    """Applies the chat template (with the request's tools, OpenAI's tool dicts, which transformers
    takes as they are) and tokenizes the result (the template adds the special tokens)."""
    tok = state.require_tokenizer("messages")
    template = state.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise APIError(
            "this model has no chat template; start the server with --chat-template", param="messages"
        )
    try:
        text = tok.apply_chat_template(
            template_messages(req.messages),
            tools=tools,
            chat_template=template,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **req.chat_template_kwargs,
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template that rejects the messages is the client's error
        raise APIError(f"the chat template could not render these messages: {e}", param="messages") from None
    return tok.encode(text, add_special_tokens=False)


async def create_chat_completion(state: ServerState, body: dict, request) -> Response:
    req = parse_chat(body, state.max_logprobs, state.research_limits)
    deadline = deadline_of(req.common)
    model = check_model(req.common.model, state.served_names)
    plan = plan_tool_calls(tool_request(req), auto_tool_choice=state.auto_tool_choice)
    if plan.schema is not None:
        req.common.sampling["structured_outputs"] = StructuredOutputsParams(json=plan.schema)
    tool_parser = TOOL_PARSERS[state.tool_call_parser] if plan.mode == "auto" else None
    if (
        tool_parser is not None
        and tool_parser.needs_special_tokens
        and body.get("skip_special_tokens") is None
    ):
        req.common.sampling["skip_special_tokens"] = False
    reasoning = REASONING_PARSERS[state.reasoning_parser] if state.reasoning_parser else None

    def reader(stream: bool) -> ChoiceReader | None:
        return (
            ChoiceReader(plan, tool_parser, reasoning, stream=stream)
            if needs_reader(plan, reasoning)
            else None
        )

    tok = state.tokenizer
    ids = render_chat(state, req, plan.tools)
    check_prompt_ids(ids, state.vocab_size, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(
        req.common,
        len(ids),
        state.max_model_len,
        logprobs=logprobs,
        prompt_logprobs=req.common.prompt_logprobs,
        prompt_param="messages",
        vocab_size=state.vocab_size,
        max_kv_tokens=state.max_kv_tokens,
    )
    research = req.common.sampling.get("research")
    if research is not None:
        requests = [(len(ids), params.max_tokens, params.n)]
        check_research(
            research, req.common.research_field, requests, state.research_model, state.research_limits
        )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    state.log_request(rid, ids, params)
    created = int(time.time())
    stream = tracked(
        state.engine, ids, params, rid, state.metrics, req.common.priority, req.common.timeout, deadline
    )
    try:
        (stream,) = await start_all([stream], request, state.disconnect_poll_s)
    except ClientDisconnected:
        return Response(status_code=499)
    top_n = req.top_logprobs or 0

    if not req.common.stream:
        try:
            (ro,) = await collect(request, [stream], state.disconnect_poll_s)
        except ClientDisconnected:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for o in sorted(ro.outputs, key=lambda o: o.index):
            completion_tokens += len(o.token_ids)
            lp = chat_logprobs(tok, list(o.token_ids), o.logprobs, top_n) if req.logprobs else None
            r = reader(stream=False)
            choice = {
                "index": o.index,
                "message": r.message(o.text) if r else {"role": "assistant", "content": o.text},
                "logprobs": lp,
                "finish_reason": r.finish_reason(o.finish_reason) if r else o.finish_reason,
            }
            if (rs := await choice_research_async(o.captures, stream=False)) is not None:
                choice["research"] = rs
            choices.append(choice)
        prompt_tokens = len(ro.prompt_token_ids) or len(ids)
        response = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        if req.common.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(
                tok, ids, ro.prompt_logprobs, req.common.prompt_logprobs
            )
        return RawTextJSONResponse(response)

    include_usage = req.common.include_usage

    def chunk(choices: list[dict], usage=False) -> dict:
        c = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = usage if usage is not False else None
        return c

    async def events():
        started: set[int] = set()  # choices whose role chunk went out
        readers: dict[int, ChoiceReader | None] = {}
        prompt_tokens, completion_tokens = len(ids), 0
        merged = merge([stream])
        try:
            async for _, ro in merged:
                prompt_tokens = len(ro.prompt_token_ids) or prompt_tokens
                # DELTA: the choices with something new (the first output lists them all), only the new.
                for o in ro.outputs:
                    completion_tokens += len(o.token_ids)
                    if o.index not in started:
                        started.add(o.index)
                        yield sse(
                            chunk(
                                [
                                    {
                                        "index": o.index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
                    # the positions new in this output
                    rs = await choice_research_async(o.captures, stream=True)
                    if not o.text and not o.token_ids and o.finish_reason is None and rs is None:
                        continue
                    lp = chat_logprobs(tok, o.token_ids, o.logprobs, top_n) if req.logprobs else None
                    if o.index not in readers:
                        readers[o.index] = reader(True)
                    r = readers[o.index]
                    finish_reason = o.finish_reason
                    if r is None:
                        delta = {"content": o.text} if o.text or o.finish_reason is None else {}
                    elif o.finish_reason is None:
                        delta = r.feed(o.text)
                    else:
                        delta = r.last(o.text)
                        finish_reason = r.finish_reason(o.finish_reason)
                    if r is not None and not delta and finish_reason is None and lp is None and rs is None:
                        continue  # the reader holds this text back: nothing to send yet
                    choice = {
                        "index": o.index,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": finish_reason,
                    }
                    if rs is not None:
                        choice["research"] = rs
                    yield sse(chunk([choice]))
            if include_usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                yield sse(chunk([], usage))
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param, e.code))
        except Exception as e:  # noqa: BLE001 - reported in-stream, the server keeps serving
            yield sse(error_body(f"internal error: {e!r}", 500))
        finally:
            await shielded(merged.aclose())
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
