"""POST /v1/completions: prompts -> token ids -> one engine request per prompt -> OpenAI's response.

Choice `i * n + j` is sample j of prompt i (as vLLM numbers them). Streaming sends each choice's new
text as the engine produces it (its DELTA outputs); `echo` prepends the prompt (and its logprobs when
`logprobs` is set). A single response is made from each prompt's FINAL_ONLY output. With `research`
(server/research.py) each choice carries its captures; a streamed chunk carries the positions new in it.
"""

from __future__ import annotations

import time
import uuid

from starlette.responses import Response, StreamingResponse

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
from jaxllm.server.logprobs import completion_logprobs, prompt_logprobs_json
from jaxllm.server.protocol import parse_completion
from jaxllm.server.research import check_research, choice_research_async
from jaxllm.server.state import ServerState
from jaxllm.server.streaming import DONE, SSE_HEADERS, RawTextJSONResponse, sse


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def create_completion(state: ServerState, body: dict, request) -> Response:
    req = parse_completion(body, state.max_logprobs, state.research_limits)
    deadline = deadline_of(req.common)
    model = check_model(req.common.model, state.served_names)
    tok = state.tokenizer
    prompts: list[tuple[str, list[int]]] = []
    for p in req.prompts:
        if isinstance(p, str):
            ids = state.require_tokenizer("prompt").encode(p) if p else []
            prompts.append((p, ids))
        else:
            check_prompt_ids(p, state.vocab_size, "prompt")
            prompts.append((tok.decode(p) if tok is not None else "", p))
    # Echoing with logprobs shows the prompt's logprobs too; an explicit prompt_logprobs is returned as is.
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    asked = [n for n in (echoed, req.common.prompt_logprobs) if n is not None]
    params = []
    for _, ids in prompts:
        check_prompt_ids(ids, state.vocab_size, "prompt")
        params.append(
            make_sampling_params(
                req.common,
                len(ids),
                state.max_model_len,
                logprobs=req.logprobs,
                prompt_logprobs=max(asked) if asked else None,
                vocab_size=state.vocab_size,
                max_kv_tokens=state.max_kv_tokens,
            )
        )
    research = req.common.sampling.get("research")
    if research is not None:
        requests = [(len(ids), sp.max_tokens, sp.n) for (_, ids), sp in zip(prompts, params, strict=True)]
        check_research(
            research, req.common.research_field, requests, state.research_model, state.research_limits
        )
    rid = f"cmpl-{uuid.uuid4().hex}"
    for i, ((_, ids), sp) in enumerate(zip(prompts, params, strict=True)):
        state.log_request(f"{rid}-{i}", ids, sp)
    created = int(time.time())
    priority = req.common.priority
    streams = [
        tracked(state.engine, ids, sp, f"{rid}-{i}", state.metrics, priority, req.common.timeout, deadline)
        for i, ((_, ids), sp) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        streams = await start_all(streams, request, state.disconnect_poll_s)
    except ClientDisconnected:
        return Response(status_code=499)
    n = req.common.sampling["n"]
    top_n = req.logprobs or 0

    if not req.common.stream:
        try:
            finals = await collect(request, streams, state.disconnect_poll_s)
        except ClientDisconnected:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, ro in enumerate(finals):
            prompt_text, prompt_ids = prompts[i]
            prompt_tokens += len(ro.prompt_token_ids) or len(prompt_ids)
            for o in sorted(ro.outputs, key=lambda o: o.index):
                completion_tokens += len(o.token_ids)
                text = (prompt_text + o.text) if req.echo else o.text
                lp = None
                if req.logprobs is not None:
                    ids, positions = list(o.token_ids), o.logprobs
                    if req.echo:
                        pl = ro.prompt_logprobs or [None] * len(prompt_ids)
                        ids = list(prompt_ids) + ids
                        positions = list(pl) + list(positions or [{}] * len(o.token_ids))
                    lp = completion_logprobs(tok, ids, positions, top_n)
                choice = {
                    "index": i * n + o.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                }
                if (rs := await choice_research_async(o.captures, stream=False)) is not None:
                    choice["research"] = rs
                if req.common.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        tok, prompt_ids, ro.prompt_logprobs, req.common.prompt_logprobs
                    )
                choices.append(choice)
        return RawTextJSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    include_usage = req.common.include_usage

    async def events():
        started: set[int] = set()  # choices that have had a chunk
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        merged = merge(streams)
        try:
            async for i, ro in merged:
                prompt_text, prompt_ids = prompts[i]
                prompt_tokens[i] = len(ro.prompt_token_ids) or len(prompt_ids)
                # DELTA: the choices with something new (the first output lists them all), only the new.
                for o in ro.outputs:
                    index = i * n + o.index
                    completion_tokens += len(o.token_ids)
                    text, ids, positions = o.text, o.token_ids, o.logprobs
                    if index not in started:
                        started.add(index)
                        if req.echo:  # the first output of a request carries its prompt logprobs
                            text = prompt_text + text
                            pl = ro.prompt_logprobs or [None] * len(prompt_ids)
                            ids = list(prompt_ids) + ids
                            positions = list(pl) + list(positions or [{}] * len(o.token_ids))
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(tok, ids, positions, top_n, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(text)
                    choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason}
                    if (rs := await choice_research_async(o.captures, stream=True)) is not None:
                        choice["research"] = rs  # the positions new in this chunk
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
            if include_usage:
                usage = _usage(sum(prompt_tokens.values()), completion_tokens)
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param, e.code))
        except Exception as e:  # noqa: BLE001 - reported in-stream, the server keeps serving
            yield sse(error_body(f"internal error: {e!r}", 500))
        finally:
            await shielded(merged.aclose())
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
