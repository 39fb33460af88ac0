"""vLLM's metric names: every `jaxllm:` series has a `vllm:` twin (vLLM's labels and bucket bounds, the same
counts), vLLM's per-request histograms count what the requests did (hand-computed from the requests' own
parameters and tokens), and the process metrics are there. On the mock engine (fast, every output kind)
and on the real engine with the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import os
import re

import httpx
import pytest

from tests.server.prom_text import bucket_bounds, samples, value

# vLLM v1's bounds (vllm/v1/metrics/loggers.py), written out here as the reference the twins must match.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
             20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0]  # fmt: skip
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
VLLM_ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS_256 = [1, 2, 5, 10, 20, 50, 100, 200]  # vLLM's 1-2-5 bounds up to max_model_len=256 (the mock's)
TOKENS_512 = [1, 2, 5, 10, 20, 50, 100, 200, 500]

VLLM_BOUNDS = {
    "time_to_first_token_seconds": VLLM_TTFT,
    "inter_token_latency_seconds": VLLM_ITL,
    "time_per_output_token_seconds": VLLM_ITL,
    "request_time_per_output_token_seconds": VLLM_ITL,
    "e2e_request_latency_seconds": VLLM_REQUEST,
    "request_queue_time_seconds": VLLM_REQUEST,
    "request_inference_time_seconds": VLLM_REQUEST,
    "request_prefill_time_seconds": VLLM_REQUEST,
    "request_decode_time_seconds": VLLM_REQUEST,
    "request_params_n": [1, 2, 5, 10, 20],
    "iteration_tokens_total": VLLM_ITERATION,
    # jaxllm's own (vLLM has none): the twin keeps every bound
    "request_spec_decode_acceptance_rate": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
}
TOKEN_HISTOGRAMS = [
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
]
# The per-request histograms vLLM's dashboards read (examples/observability/prometheus_grafana/grafana.json
# and the deployment seeds), the gauges and counters beside them.
VLLM_DASHBOARD_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
    *(f"vllm:{name}_bucket" for name in [*VLLM_BOUNDS, *TOKEN_HISTOGRAMS]),
]


def _twin_key(name: str, labels: frozenset) -> tuple[str, frozenset]:
    return "vllm:" + name[len("jaxllm:") :], labels | {("engine", "0")}


def check_twins(text: str, token_bounds: list[int]) -> None:
    got = samples(text)
    bounds = {**VLLM_BOUNDS, **dict.fromkeys(TOKEN_HISTOGRAMS, token_bounds)}
    ours = {k: v for k, v in got.items() if k[0].startswith("jaxllm:")}
    assert len(ours) > 100
    for (name, labels), v in ours.items():
        base = name[len("jaxllm:") :]
        le = dict(labels).get("le")
        family = base.removesuffix("_bucket")
        if le is not None and le != "+Inf" and float(le) not in bounds[family]:
            assert _twin_key(name, labels) not in got, (name, le)  # not one of vLLM's bounds: left out
            continue
        assert got.get(_twin_key(name, labels)) == v, (
            name,
            dict(labels),
            v,
            got.get(_twin_key(name, labels)),
        )
    for family, expected in bounds.items():
        assert bucket_bounds(got, f"vllm:{family}") == [float(b) for b in expected], family
    # vLLM's older name of the inter-token latency (dashboards of vLLM <= 0.10): the same observations
    for suffix in ("_count", "_sum"):
        assert value(got, f"vllm:time_per_output_token_seconds{suffix}") == value(
            got, f"vllm:inter_token_latency_seconds{suffix}"
        )
    names = {n for n, _ in got}
    assert set(VLLM_DASHBOARD_SERIES) <= names, set(VLLM_DASHBOARD_SERIES) - names


def _count_prompt(base_url_or_client, body: dict) -> int:
    """The prompt's token count by the server's own /tokenize (the request's prompt, as the server sees it)."""
    if "messages" in body:
        req = {"messages": body["messages"]}
    else:
        req = {"prompt": body["prompt"]}
    r = base_url_or_client.post("/tokenize", json=req)
    assert r.status_code == 200, r.text
    return r.json()["count"]


HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_time_per_output_token_seconds",
    *TOKEN_HISTOGRAMS,
    "request_params_n",
]


def _stats(text: str) -> dict[str, float]:
    got = samples(text)
    out = {}
    for h in HISTOGRAMS:
        for suffix in ("_count", "_sum"):
            out[h + suffix] = value(got, f"vllm:{h}{suffix}")
    out["success_length"] = value(got, "vllm:request_success_total", finished_reason="length")
    out["generation_tokens_total"] = value(got, "vllm:generation_tokens_total")
    out["params_n_le_1"] = value(got, "vllm:request_params_n_bucket", le="1.0")
    out["generation_le_5"] = value(got, "vllm:request_generation_tokens_bucket", le="5.0")
    return out


def run_and_measure(http, body: dict, max_tokens: int, n: int):
    """Sends one request (ignore_eos: each sample makes exactly max_tokens tokens, or max_tokens=None:
    what the context leaves) and returns the metrics' change, the prompt's length and max_tokens."""
    prompt_len = _count_prompt(http, body)
    before = _stats(http.get("/metrics").text)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(path, json={**body, "n": n, "ignore_eos": True, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    after = _stats(http.get("/metrics").text)
    return {k: after[k] - before[k] for k in after}, prompt_len


def check_one_request(d: dict, prompt_len: int, max_tokens: int, n: int, stream: bool) -> None:
    """What one request of n samples, each exactly max_tokens long, must add (vLLM's counting: samples for
    request_success and request_generation_tokens, the request once for the rest)."""
    tokens = max_tokens
    for h in HISTOGRAMS:
        if h == "inter_token_latency_seconds":
            assert d[h + "_count"] == tokens - 1, (h, d[h + "_count"])
        elif h == "request_generation_tokens":
            assert d[h + "_count"] == n and d[h + "_sum"] == n * tokens, (h, d)
        else:
            assert d[h + "_count"] == 1, (h, stream, d[h + "_count"])
    assert d["success_length"] == n
    assert d["generation_tokens_total"] == n * tokens  # the engine's counter agrees with the requests
    assert d["request_prompt_tokens_sum"] == prompt_len
    assert d["request_max_num_generation_tokens_sum"] == tokens
    assert d["request_params_max_tokens_sum"] == max_tokens
    assert d["request_params_n_sum"] == n and d["params_n_le_1"] == (1 if n == 1 else 0)
    assert d["generation_le_5"] == (n if tokens <= 5 else 0)
    # The phases as vLLM defines them: inference = prefill + decode; time per output token = decode / (k-1)
    prefill, decode = d["request_prefill_time_seconds_sum"], d["request_decode_time_seconds_sum"]
    assert d["request_inference_time_seconds_sum"] == pytest.approx(prefill + decode, abs=1e-6)
    assert d["request_time_per_output_token_seconds_sum"] == pytest.approx(decode / (tokens - 1), abs=1e-6)
    assert prefill >= 0 and decode > 0
    # The server's end-to-end time holds the engine's whole run of the request.
    assert d["e2e_request_latency_seconds_sum"] >= d["request_inference_time_seconds_sum"] - 1e-3


CASES = [  # (body, max_tokens, n)
    ({"prompt": "hello world the cat sat", "stream": False}, 5, 1),
    ({"prompt": "the dog ran over the mat", "stream": True, "temperature": 1.0, "seed": 3}, 7, 2),
    ({"messages": [{"role": "user", "content": "hello"}], "stream": False}, 3, 1),
    ({"messages": [{"role": "user", "content": "red blue"}], "stream": True}, 4, 1),
]


@pytest.mark.parametrize("body, max_tokens, n", CASES)
def test_per_request_histograms_count_what_the_request_did(client, body, max_tokens, n):
    d, prompt_len = run_and_measure(client, body, max_tokens, n)
    check_one_request(d, prompt_len, max_tokens, n, body["stream"])


def test_max_tokens_left_out_is_what_the_context_leaves(client, engine):
    """A chat request without max_tokens may use what the context leaves, and that is the max_tokens the
    histogram sees, as in vLLM: max_model_len - prompt length (the mock's max_model_len: 256)."""
    body = {"messages": [{"role": "user", "content": "one two three four"}]}
    prompt_len = _count_prompt(client, body)
    before = value(client.get("/metrics").text, "vllm:request_params_max_tokens_sum")
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    after = value(client.get("/metrics").text, "vllm:request_params_max_tokens_sum")
    assert after - before == engine.max_model_len - prompt_len


def test_every_jaxllm_series_has_its_vllm_twin(client):
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True})
    check_twins(client.get("/metrics").text, TOKENS_256)


def test_process_metrics_describe_this_process(client):
    """prometheus_client's process collector (as in vLLM's default registry): this process's memory and
    open files, checked against /proc (the TestClient serves in this process)."""
    text = client.get("/metrics").text
    got = samples(text)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert value(got, "process_resident_memory_bytes") == pytest.approx(rss, rel=0.2)
    assert abs(value(got, "process_open_fds") - len(os.listdir("/proc/self/fd"))) <= 5
    assert value(got, "process_cpu_seconds_total") > 0
    assert any(n == "python_info" for n, _ in got)
    assert any(n == "python_gc_objects_collected_total" for n, _ in got)


# ---- the real engine on the embedded model


@pytest.fixture(scope="module")
def real_http():
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.engine_args import EngineArgs
    from jaxllm.server.app import build_app
    from tests.server.conftest import LiveServer

    # With speculative decoding: the per-request histograms must count the same with it
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=512, max_num_seqs=8, speculative_config=spec)
    )
    with (
        LiveServer(build_app(engine, disconnect_poll_s=0.05)) as s,
        httpx.Client(base_url=s.url, timeout=600) as c,
    ):
        yield c


def test_vllm_metrics_on_the_embedded_model(real_http):
    for body, max_tokens, n in CASES:
        d, prompt_len = run_and_measure(real_http, body, max_tokens, n)
        check_one_request(d, prompt_len, max_tokens, n, body["stream"])
    text = real_http.get("/metrics").text
    check_twins(text, TOKENS_512)
    got = samples(text)
    (info,) = [dict(ls) for (n, ls), _ in got.items() if n == "vllm:cache_config_info"]
    assert info["block_size"] == "16" and info["engine"] == "0" and int(info["num_gpu_blocks"]) > 0
    assert value(got, "vllm:num_requests_running") == 0 and value(got, "vllm:kv_cache_usage_perc") == 0


def test_speculative_decoding_counters(real_http):
    """A request that copies its prompt: proposals made and accepted are counted (the engine's counters,
    by position too), its acceptance rate lands in the per-request histogram, and vLLM's twins agree."""
    before = samples(real_http.get("/metrics").text)
    passage = "the old stone bridge crosses the river at the end of the long road to the village"
    body = {
        "messages": [{"role": "user", "content": f"Repeat this exactly: {passage}. Repeat: {passage}."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    assert real_http.post("/v1/chat/completions", json=body).status_code == 200
    got = samples(real_http.get("/metrics").text)

    def delta(name: str, **labels) -> float:
        return value(got, name, **labels) - value(before, name, **labels)

    drafts = delta("jaxllm:spec_decode_num_draft_tokens_total")
    accepted = delta("jaxllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert delta("jaxllm:spec_decode_num_drafts_total") > 0
    assert value(got, "jaxllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") >= value(
        got, "jaxllm:spec_decode_num_accepted_tokens_per_pos_total", position="1"
    )
    assert delta("jaxllm:request_spec_decode_acceptance_rate_count") == 1
    rate = delta("jaxllm:request_spec_decode_acceptance_rate_sum")
    assert rate == pytest.approx(accepted / drafts, abs=1e-6)  # the one request's own share
    assert value(got, "vllm:spec_decode_num_accepted_tokens_total", engine="0") == value(
        got, "jaxllm:spec_decode_num_accepted_tokens_total"
    )


def _documented_series() -> tuple[set[str], set[str]]:
    """The series docs/deployment.md's Metrics tables list: (after the prefix, without a prefix)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    prefixed, plain = section.split("Without a prefix", 1)
    names = [
        {
            n
            for line in part.splitlines()
            if line.startswith("| `")
            for n in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])
        }
        for part in (prefixed, plain)
    ]
    return names[0], names[1]


def test_the_metrics_page_lists_every_series(client):
    """docs/deployment.md names each series as a query does (counters with _total, histograms by their
    base name); every one exported is listed, and every one listed is exported."""
    from prometheus_client.parser import text_string_to_metric_families

    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    exported = {}
    for f in text_string_to_metric_families(client.get("/metrics").text):
        if f.name.endswith("_created"):
            continue
        exported[f.name] = f.name + "_total" if f.type == "counter" else f.name
    ours = {q[len("jaxllm:") :] for n, q in exported.items() if n.startswith("jaxllm:")}
    plain = {q for n, q in exported.items() if ":" not in n}
    prefixed_doc, plain_doc = _documented_series()
    assert prefixed_doc == ours
    assert plain_doc == plain
