"""`research` through the OpenAI-compatible server, with the official openai client, on the real engine and
the embedded SmolLM2-135M (float32 on the CPU): the captures a choice carries (base64 arrays) are exactly
the offline `LLM`'s for the same greedy request, streamed and not, on both routes and under
`vllm_xargs.research`; a steer changes the text exactly as offline; without --enable-research-api the
field is refused; every bad value is a 400 naming its field; the capture-size limit is the exact count of
what a request could capture; and bad research requests leave a concurrent request's output untouched."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import numpy as np
import pytest

from jaxllm import LLM, Patch, ResearchParams, SamplingParams, Scale, Steer
from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine_args import EngineArgs
from jaxllm.outputs import Captures
from jaxllm.research_wire import decode_captures, encode_captures, merge_captures
from jaxllm.server.app import build_app
from jaxllm.server.research import ResearchLimits
from tests.server.conftest import LiveServer
from tests.server.mock_engine import MockAsyncEngine

openai = pytest.importorskip("openai")

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
NEW = 5
SITES = ["residual.3", "attn_out.29", "mlp_out.10", "final_norm", "logits"]
# Both prompts fall in one token bucket (17..32 tokens), and every request that captures asks for SITES at
# "all" positions: the two engines compile few step variants, which keeps this file to about a minute.
PROMPT = (
    "The capital of France is Paris, the capital of Italy is Rome, the capital of Japan is Tokyo, and the "
    "capital of Spain is"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a planet."}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla"))


@pytest.fixture(scope="module")
def llm(cache):
    return LLM(**ENGINE, compilation_cache_dir=cache)


@pytest.fixture(scope="module")
def dims(llm):
    arch = llm.llm_engine.loaded.arch
    assert llm.llm_engine.loaded.dtype == np.float32  # what site_bytes counts
    return arch.hidden_size, arch.vocab_size, arch.num_layers


def site_bytes(dims) -> int:
    """Bytes one position of SITES takes (float32 on the CPU): 4 sites of hidden_size, one of vocab_size."""
    hidden, vocab, _ = dims
    return 4 * (4 * hidden + vocab)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    return llm.get_tokenizer()(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def captured(llm, prompt_ids):
    """The offline greedy output of PROMPT capturing SITES at every position."""
    return offline(llm, prompt_ids, ResearchParams(capture=SITES))


@pytest.fixture(scope="module")
def limit_rows(prompt_ids) -> int:
    """The server's capture limit, in positions of SITES: exactly what the completion tests capture."""
    return len(prompt_ids) + NEW - 1


@pytest.fixture(scope="module")
def server(llm, dims, cache, limit_rows):
    limits = ResearchLimits(
        enabled=True, max_capture_bytes=limit_rows * site_bytes(dims), max_sites=8, max_steers=2
    )
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**ENGINE, compilation_cache_dir=cache))
    with LiveServer(build_app(engine, disconnect_poll_s=0.05, research_limits=limits)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", timeout=600, max_retries=0)


def offline(llm, ids: list[int], research: ResearchParams | None, max_tokens: int = NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, research=research)
    (out,) = llm.generate(None, params, prompt_token_ids=[ids], use_tqdm=False)
    return out.outputs[0]


def assert_same_captures(got: Captures, want: Captures) -> None:
    assert got.positions == want.positions
    assert sorted(got.arrays) == sorted(want.arrays)
    for site, a in want.arrays.items():
        assert got.arrays[site].dtype == a.dtype == np.float32, site
        np.testing.assert_array_equal(got.arrays[site], a, err_msg=site)  # bit-exact


def streamed_research(chunks) -> tuple[str, Captures]:
    text, parts = "", []
    for chunk in chunks:
        for c in chunk.choices:
            text += getattr(c, "text", None) or (c.delta.content if hasattr(c, "delta") else "") or ""
            rs = getattr(c, "research", None)
            if rs is not None:
                parts.append(decode_captures(rs))
    return text, merge_captures(parts)


def test_wire_round_trip_is_exact():
    import ml_dtypes

    rng = np.random.default_rng(0)
    caps = Captures(
        [3, 4, 9],
        {
            "residual.1": rng.standard_normal((3, 7)).astype(np.float32),
            "mlp_out.2": rng.standard_normal((3, 7)).astype(ml_dtypes.bfloat16),
        },
    )
    wire = encode_captures(caps)
    assert wire["captures"]["mlp_out.2"]["dtype"] == "bfloat16"
    assert wire["captures"]["residual.1"]["shape"] == [3, 7]
    back = decode_captures(wire)
    assert back.positions == [3, 4, 9]
    for site, a in caps.arrays.items():
        assert back.arrays[site].dtype == a.dtype
        assert back.arrays[site].tobytes() == a.tobytes()
    # bfloat16 without ml_dtypes: uint16 shifted into the top half of a float32
    raw = np.frombuffer(
        __import__("base64").b64decode(wire["captures"]["mlp_out.2"]["data"]), np.uint16
    ).reshape(3, 7)
    as_f32 = (raw.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(as_f32, caps.arrays["mlp_out.2"].astype(np.float32))


def test_completion_captures_equal_offline(client, prompt_ids, captured):
    ids, want = prompt_ids, captured
    research = {"capture": SITES, "capture_positions": "all"}
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=ids, max_tokens=NEW, temperature=0)
    r = client.completions.create(**kw, extra_body={"research": research, "ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == want.text
    assert_same_captures(decode_captures(choice.research), want.captures)
    assert want.captures.positions == list(range(len(ids) + NEW - 1))
    # the same object under vLLM's vllm_xargs, there also as its JSON text
    for xargs in ({"research": research}, {"research": json.dumps(research)}):
        r = client.completions.create(**kw, extra_body={"vllm_xargs": xargs, "ignore_eos": True})
        assert_same_captures(decode_captures(r.choices[0].research), want.captures)
    # streamed: each chunk carries the positions new in it; together they are the whole
    stream = client.completions.create(
        **kw, stream=True, extra_body={"research": research, "ignore_eos": True}
    )
    text, caps = streamed_research(stream)
    assert text == want.text
    assert_same_captures(caps, want.captures)


def test_chat_captures_equal_offline(llm, client, server, prompt_ids):
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert 16 < len(ids) <= len(prompt_ids) <= 32  # one token bucket; within the capture limit
    research = {"capture": SITES, "capture_positions": "all"}
    want = offline(llm, ids, ResearchParams(capture=SITES))
    assert want.captures.positions == list(range(len(ids) + NEW - 1))
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=MESSAGES, max_tokens=NEW, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"research": research, "ignore_eos": True})
    assert r.choices[0].message.content == want.text
    assert_same_captures(decode_captures(r.choices[0].research), want.captures)
    stream = client.chat.completions.create(
        **kw, stream=True, extra_body={"research": research, "ignore_eos": True}
    )
    text, caps = streamed_research(stream)
    assert text == want.text
    assert_same_captures(caps, want.captures)


def test_interventions_change_the_text_as_offline(llm, client, dims, prompt_ids, captured):
    """A steer, then a head ablated with a residual patched: over HTTP the same text and captures as
    offline (and the steer did change the text)."""
    ids = prompt_ids
    model = client.models.list().data[0].id
    vector = np.random.default_rng(1).standard_normal(dims[0]).astype(np.float32)
    patch = np.random.default_rng(2).standard_normal(dims[0]).astype(np.float32)
    cases = [
        (
            dict(steer=[Steer("residual.5", vector, 4.0)]),
            {"steer": [{"site": "residual.5", "vector": vector.tolist(), "scale": 4.0}]},
        ),
        (
            dict(scale=[Scale("attn_out.1", 0.0, head=2)], patch=[Patch("residual.3", 2, patch)]),
            {
                "scale": [{"site": "attn_out.1", "factor": 0.0, "head": 2}],
                "patch": [{"site": "residual.3", "position": 2, "vector": patch.tolist()}],
            },
        ),
    ]
    for k, (edits, body) in enumerate(cases):
        want = offline(llm, ids, ResearchParams(capture=SITES, **edits))
        if k == 0:
            assert want.token_ids != captured.token_ids  # the steer did something
        r = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=NEW,
            temperature=0,
            extra_body={"research": {"capture": SITES, **body}, "ignore_eos": True},
        )
        assert r.choices[0].text == want.text, edits
        assert_same_captures(decode_captures(r.choices[0].research), want.captures)


def test_refused_without_the_flag():
    """A server without --enable-research-api refuses the field (whatever its content); with the flag, a
    model without research sites refuses it too."""
    for limits, needle in (
        (None, "--enable-research-api"),
        (ResearchLimits(enabled=True), "no research sites"),
    ):
        with LiveServer(build_app(MockAsyncEngine(), research_limits=limits, log_stats=False)) as s:
            c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="EMPTY", max_retries=0)
            for extra, param in (
                ({"research": {"capture": ["residual.0"]}}, "research"),
                (
                    {"research": {"capture": ["nonsense"]}},
                    "research" if limits is None else "research.capture",
                ),
                ({"vllm_xargs": {"research": {"capture": ["logits"]}}}, "vllm_xargs.research"),
            ):
                with pytest.raises(openai.BadRequestError) as e:
                    c.completions.create(model="mock-model", prompt="hi", max_tokens=2, extra_body=extra)
                assert e.value.body["param"] == param
                assert e.value.body["message"].startswith(param + ":")
                if param != "research.capture":
                    assert needle in e.value.body["message"]
            # a request without research is served as before (greedy: a sampled first token may be eos)
            out = c.completions.create(model="mock-model", prompt="hi", max_tokens=2, temperature=0)
            assert out.choices[0].text and out.usage.completion_tokens == 2


def bad_cases(hidden: int, layers: int) -> list[tuple[dict, str]]:
    ok = [0.5] * hidden
    return [
        ({"capture": ["resid.3"]}, "research.capture"),
        ({"capture": [f"residual.{layers}"]}, "research.capture"),
        ({"capture": ["residual.1", "residual.1"]}, "research.capture"),
        ({"capture": "residual.1"}, "research.capture"),
        ({"capture": [f"mlp_out.{i}" for i in range(9)]}, "research.capture"),  # more than max_sites
        ({"capture": ["logits"], "capture_positions": "end"}, "research.capture_positions"),
        ({"steer": [{"site": "residual.1", "vector": ok + [0.5]}]}, "research.steer[0].vector"),
        ({"steer": [{"site": "residual.1", "vector": []}]}, "research.steer[0].vector"),
        ({"steer": [{"site": "residual.1", "vector": ["a"] + ok[1:]}]}, "research.steer[0].vector[0]"),
        ({"steer": [{"site": "logits", "vector": ok}]}, "research.steer[0].site"),
        (
            {"steer": [{"site": "residual.1", "vector": ok}, {"site": f"attn_out.{layers}", "vector": ok}]},
            "research.steer[1].site",
        ),
        ({"steer": [{"site": "residual.1", "vector": ok, "scale": "big"}]}, "research.steer[0].scale"),
        ({"steer": [{"site": "residual.1", "vector": ok}] * 3}, "research.steer"),  # more than max_steers
        ({"scale": [{"site": "mlp_out.1", "factor": 0.0, "head": 2}]}, "research.scale[0].head"),
        ({"scale": [{"site": "attn_out.1", "factor": 0.0, "head": 10**6}]}, "research.scale[0].head"),
        ({"scale": [{"site": f"mlp_out.{layers}"}]}, "research.scale[0].site"),
        ({"patch": [{"site": "residual.1", "position": -1, "vector": ok}]}, "research.patch[0].position"),
        ({"patch": [{"site": "residual.1", "position": 0, "vector": ok[1:]}]}, "research.patch[0].vector"),
        ({"scale": [{"site": "attn_out.1", "factor": 0.5, "head": 0}]}, None),
        ({"capture": SITES, "bogus": 1}, None),  # an unknown key is ignored, as everywhere
        ({}, "research"),
        ("residual.1", "research"),
    ]


def test_every_bad_value_is_a_400_naming_its_field(server, dims, prompt_ids):
    hidden, _, layers = dims
    url = f"{server.url}/v1/completions"
    for research, param in bad_cases(hidden, layers):
        body = {"prompt": prompt_ids, "max_tokens": 1, "research": research}
        r = httpx.post(url, json=body, timeout=600)
        if param is None:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, (research, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (research, err)
        assert err["message"].startswith(param + ":"), err
    both = {
        "prompt": "Hi",
        "research": {"capture": ["logits"]},
        "vllm_xargs": {"research": {"capture": ["logits"]}},
    }
    r = httpx.post(url, json=both, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "research, vllm_xargs.research"
    r = httpx.post(url, json={"prompt": "Hi", "vllm_xargs": {"research": "{not json"}}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.research"
    chat = {"messages": MESSAGES, "research": {"steer": [{"site": "residual.0", "vector": [1.0]}]}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "research.steer[0].vector"


def test_capture_size_limit_is_the_count_of_what_a_request_can_capture(server, prompt_ids, limit_rows):
    """The limit is exactly the completion tests' request (served there): its positions (prompt plus
    max_tokens - 1 for "all", prompt alone for "prompt", max_tokens - 1 for "generated") times the samples
    times SITES' bytes. One position more is refused before anything runs."""
    url = f"{server.url}/v1/completions"
    p = len(prompt_ids)

    def ask(prompt_len: int, positions: str, max_tokens: int = 1, n: int = 1) -> httpx.Response:
        research = {"capture": SITES, "capture_positions": positions}
        body = {"prompt": [7] * prompt_len, "max_tokens": max_tokens, "n": n, "temperature": 0}
        return httpx.post(url, json={**body, "research": research}, timeout=600)

    assert p + NEW - 1 == limit_rows
    r = ask(p, "all", max_tokens=NEW)  # exactly the limit
    assert r.status_code == 200, r.text
    assert decode_captures(r.json()["choices"][0]["research"]).positions == list(range(limit_rows))
    for refused in (
        ask(p, "all", max_tokens=NEW + 1),
        ask(p + NEW, "prompt"),
        ask(2, "generated", max_tokens=limit_rows + 2),
        ask(limit_rows // 2 + 1, "prompt", n=2),
        ask(1, "all", max_tokens=limit_rows // 3 + 1, n=3),
    ):
        assert refused.status_code == 400, refused.text
        err = refused.json()["error"]
        assert err["param"] == "research.capture" and "--max-research-capture-bytes" in err["message"]


def test_bad_research_requests_leave_a_concurrent_request_untouched(server, dims, prompt_ids):
    """While a plain request streams, bad research requests (refused by the body's checks, the model's
    sizes and the size limit) are answered 400, and the stream's text is exactly the same request's alone."""
    hidden, _, layers = dims
    url = f"{server.url}/v1/completions"
    good = {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(url, json=good, timeout=600).json()["choices"][0]["text"]
    started, finished = threading.Event(), threading.Event()

    def stream() -> str:
        text = ""
        with httpx.stream("POST", url, json={**good, "stream": True}, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[len("data: ") :])["choices"][0]["text"]
                    started.set()
        finished.set()
        return text

    cases = [c for c in bad_cases(hidden, layers) if c[1] is not None]
    cases.append(({"capture": SITES, "capture_positions": "generated"}, "research.capture"))  # too large

    def bad(i: int) -> tuple[int, bool]:
        research, _ = cases[i % len(cases)]
        body = {"prompt": "Hi", "max_tokens": 200, "research": research}
        r = httpx.post(url, json=body, timeout=600)
        return r.status_code, finished.is_set()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        normal = pool.submit(stream)
        assert started.wait(600)
        answers = list(pool.map(bad, range(2 * len(cases))))
        text = normal.result()
    assert [status for status, _ in answers] == [400] * len(answers)
    assert not all(late for _, late in answers)  # some were answered while the stream ran
    assert text == alone
