"""Memory pressure and back-pressure on the real engine behind the real server (a tiny random Llama with a
byte-level tokenizer: every batch shape compiles in about a second on the CPU, where the embedded model
took minutes for the shapes a preemption burst makes), with a deliberately tiny KV cache (12 blocks of 16:
176 usable tokens, well under max_model_len):

- requests whose total demand exceeds the cache all finish, through preemption (swap and recompute), each
  with the text it has alone (greedy; a near-tie flipped by batch-dependent rounding is allowed);
- a request that could never be in the cache is refused with a 400 naming max_tokens / prompt and 176;
- past --max-num-queued-reqs a 503 with Retry-After, nothing else disturbed;
- a request's `timeout` aborts it (408, or an SSE error event) and its KV blocks come back;
- with request logging off (--disable-log-requests), no prompt or generated text reaches any log record.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import httpx
import pytest

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine_args import EngineArgs
from jaxllm.server.app import build_app
from jaxllm.server.args import ServerArgs
from jaxllm.server.request_log import RequestLogger
from jaxllm.testing.tiny_models import save_tiny_llama
from tests.server.conftest import LiveServer
from tests.server.sse import first_difference_is_a_near_tie, parse_sse

BLOCKS, BLOCK = 12, 16
CAPACITY = (BLOCKS - 1) * BLOCK  # block 0 is the null block
PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Once upon a time",
    "Water boils at",
    "My favourite animal is",
    "In 1969, humans",
]
MAX_TOKENS = 40  # each request: about 50 tokens = 4 blocks; six of them want twice the cache


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    args = EngineArgs(
        model=save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama"))),
        max_model_len=256,
        num_gpu_blocks_override=BLOCKS,
        block_size=BLOCK,
        swap_space=0.002,  # two host blocks: some preemptions swap, the rest recompute
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    with LiveServer(build_app(engine, disconnect_poll_s=0.05, log_stats=False)) as s:
        yield s, engine


def _free_blocks(engine) -> int:
    return engine.engine.scheduler.kv.num_free_blocks


def _wait_idle(engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = engine.get_stats()
        if st.num_requests_running == 0 and st.num_requests_waiting == 0 and not engine.num_queued_seqs:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.get_stats()}")


def _complete(url: str, prompt: str, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600)


def test_demand_beyond_the_cache_is_preempted_and_equals_alone(served):
    server, engine = served
    scheduler = engine.engine.scheduler
    start_free = _free_blocks(engine)
    alone = []
    for p in PROMPTS:  # one at a time: 4 blocks of 11, nothing is ever preempted
        r = _complete(server.url, p, logprobs=2)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        gaps = [(t, _gap(list(top.values()))) for t, top in zip(lp["tokens"], lp["top_logprobs"])]
        alone.append((c["text"], gaps))
    before = engine.get_stats().num_preemptions

    swapped_out = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        swapped_out.extend(out.blocks_to_swap_out)
        return out

    scheduler.schedule = recording_schedule
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            futures = [pool.submit(_complete, server.url, p) for p in PROMPTS * 2]
            got = [f.result() for f in futures]
    finally:
        scheduler.schedule = schedule
    assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
    texts = [r.json()["choices"][0] for r in got]
    assert all(c["finish_reason"] == "length" for c in texts)
    differ = []
    for i, c in enumerate(texts):
        expected, gaps = alone[i % len(PROMPTS)]
        if c["text"] != expected:
            assert first_difference_is_a_near_tie(expected, c["text"], gaps, 1e-3), (i, expected, c["text"])
            differ.append(i)
    assert len(differ) <= 2, differ
    stats = engine.get_stats()
    assert stats.num_preemptions > before, "the burst was meant to exhaust the KV cache"
    assert swapped_out, "no preemption swapped (two host blocks were free)"
    _wait_idle(engine)
    assert _free_blocks(engine) == start_free and stats.num_requests_swapped == 0


def _gap(lps: list[float]) -> float:
    lps = sorted(lps, reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def test_a_request_that_can_never_fit_is_refused_naming_the_limit(served):
    server, engine = served
    r = _complete(server.url, "Hello there", max_tokens=CAPACITY)  # under max_model_len, over the cache
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == "max_tokens" and str(CAPACITY) in e["message"], e
    long_prompt = [5] * (
        CAPACITY + 10
    )  # token ids: a prompt alone larger than the cache, within max_model_len
    r = _complete(server.url, long_prompt, max_tokens=1)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == "prompt" and str(CAPACITY) in e["message"], e
    # The engine is unharmed (once, a prompt over the cache raised on the engine thread and ended it).
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _complete(server.url, "Hello there", max_tokens=2).status_code == 200


def test_past_max_num_queued_reqs_is_503_with_retry_after(served):
    server, engine = served
    _wait_idle(engine)
    engine.max_num_queued_reqs = 2
    # Each step slowed to 50 ms, so the two requests below are still held when the third comes (the tiny
    # model would otherwise finish them in a fraction of a second).
    scheduler = engine.engine.scheduler
    schedule = scheduler.schedule

    def slow_schedule():
        time.sleep(0.05)
        return schedule()

    scheduler.schedule = slow_schedule
    try:
        r = _complete(server.url, "Hello", n=3, max_tokens=2)  # n counts n, as vLLM's
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["code"] == "server_overloaded"
        assert "--max-num-queued-reqs" in e["message"] and "2" in e["message"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [
                pool.submit(_complete, server.url, "Once upon a time", max_tokens=60, stream=s)
                for s in (False, True)
            ]
            deadline = time.monotonic() + 60
            while engine.num_queued_seqs < 2:  # both taken
                assert time.monotonic() < deadline and not any(f.done() for f in held), "not both held"
                time.sleep(0.01)
            r = _complete(server.url, "x", max_tokens=2)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert not any(f.done() for f in held), "the check came after a held request ended"
            plain, streamed = (f.result() for f in held)
        # The two requests held meanwhile were not disturbed.
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
        assert streamed.status_code == 200
        assert parse_sse(streamed.text)[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        engine.max_num_queued_reqs = None
        scheduler.schedule = schedule
    _wait_idle(engine)
    assert _complete(server.url, "Hello", max_tokens=2).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_aborts_and_frees_the_blocks(served, stream):
    server, engine = served
    _wait_idle(engine)
    start_free = _free_blocks(engine)
    # 160 tokens take far longer than the 0.02 s after which the request asks to be dropped.
    r = _complete(server.url, "Tell me a story", max_tokens=160, timeout=0.02, stream=stream)
    if stream and r.status_code == 200:  # the deadline passed after the first event: an error event
        events = parse_sse(r.text)
        e = events[-1]["error"]
    else:  # before any output (a stream's too): a 408
        assert r.status_code == 408, r.text
        e = r.json()["error"]
    assert e["param"] == "timeout" and e["code"] == "timeout" and "0.02" in e["message"], e
    _wait_idle(engine)
    assert _free_blocks(engine) == start_free
    assert engine.get_stats().kv_cache_usage == 0.0


class _Everything(logging.Handler):
    def __init__(self):
        super().__init__(level=0)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def text(self) -> str:
        out = []
        for r in self.records:
            out.append(r.getMessage())
            out.append(repr(r.args))
            if r.exc_text:
                out.append(r.exc_text)
        return "\n".join(out)


def _capture_all_logs():
    """A handler on the root logger and on every logger that does not propagate, every level at 1."""
    handler = _Everything()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(1)
        if lg is logging.getLogger() or not lg.propagate:
            lg.addHandler(handler)
    return handler, saved


def _restore(handler, saved):
    for lg, level in saved:
        lg.setLevel(level)
        if handler in lg.handlers:
            lg.removeHandler(handler)


@pytest.mark.parametrize("logged", [False, True])
def test_disable_log_requests_keeps_prompts_and_outputs_out_of_every_log(served, logged):
    server, engine = served
    state = server.server.config.app.state.server
    flags = {"enable_log_requests": True, "disable_log_requests": not logged}
    state.request_logger = ServerArgs(**flags).request_logger()
    assert (state.request_logger is not None) == logged
    marker = "Zebrafinch7Quokka"
    handler, saved = _capture_all_logs()
    try:
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": f"Say {marker} twice"}], "max_tokens": 12},
            timeout=600,
        )
        comp = _complete(server.url, f"{marker} is a word", max_tokens=12, stream=True)
    finally:
        _restore(handler, saved)
        state.request_logger = None
    assert chat.status_code == 200 and comp.status_code == 200
    logs = handler.text()
    if logged:  # the control: the capture does see what a request logger writes
        assert isinstance(state.request_logger, RequestLogger | None)
        assert marker in logs
        return
    assert handler.records, "nothing was captured at all"
    assert marker not in logs
    outputs = [chat.json()["choices"][0]["message"]["content"]] + [
        c["choices"][0]["text"] for c in parse_sse(comp.text) if c["choices"]
    ]
    for text in outputs:
        if len(text.strip()) >= 6:
            assert text.strip() not in logs, text
