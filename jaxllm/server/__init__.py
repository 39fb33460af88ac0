"""jaxllm's OpenAI-compatible HTTP server (Starlette + uvicorn).

    cli.py                 jaxllm serve: flags -> EngineArgs + ServerArgs -> AsyncLLMEngine -> build_app -> uvicorn
    args.py                the flags, generated from EngineArgs and ServerArgs (vLLM's names)
    app.py                 routes, error guard, lifespan (engine start / draining shutdown, stats log)
    protocol.py            JSON body -> typed requests (400 naming the field); the pydantic request models
                           in protocol_common.py, protocol_chat.py, protocol_completion.py
    openapi.py             GET /openapi.json, generated from those models
    serving_chat.py        /v1/chat/completions      serving_completion.py   /v1/completions
    generation.py          engine requests: context checks, abort on disconnect, merge/collect streams
    streaming.py           SSE framing and per-choice deltas   logprobs.py   OpenAI logprob shapes
    metrics.py             Prometheus (jaxllm:* names); vllm_metrics.py: their vllm:* twins;
                           http_metrics.py: requests by route and status   auth.py, body.py, errors.py, state.py
The server never imports jax: it talks to the engine through the async engine interface and the public
host types (jaxllm.outputs, jaxllm.sampling_params, jaxllm.stats, jaxllm.config, jaxllm.engine_args).
"""
