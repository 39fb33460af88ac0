"""What the fuzzing modules share: a real `jaxllm serve` on the embedded model, the bound on the work one
generated request may ask of it, the checks every answer must pass, and a concurrent sender.

    hypothesis (derandomized) --generated(strategy, n)--> requests, collected first
        --bounded--> the same requests, asking the engine for little work (see `bounded`)
        --send_all (4 at a time, so bad and good requests share engine steps)--> answers
        --problems--> what broke: a status >= 500, a 4xx without OpenAI's error shape, a stream carrying
                      an error event or not ending in [DONE], a body that is not JSON, no answer in time
The server runs as its own process so that a crash is seen as a crash (the process gone), not as a
thread of the test dying; its log is read afterwards for tracebacks.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from benchmarks.server_process import ServerProcess, launch_server

MAX_MODEL_LEN = 64  # a long prompt is refused at tokenization (cheap) rather than run
MAX_GEN_TOKENS = 2  # a valid request that would run longer is lowered to this many tokens per sequence
MAX_SEQUENCES = 2  # likewise for n and the number of prompts of one completions request
MAX_N = 128  # protocol_common.MAX_N: a larger n is refused, so it is sent as it is
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
SERVER_FLAGS = (
    f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs 4 --max-num-batched-tokens {MAX_MODEL_LEN} "
    "--uvicorn-log-level warning --disable-log-stats"
)
GREEDY_PROBES = (
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0},
    ),
)
ERROR_KEYS = {"message", "type", "param", "code"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FuzzServer:
    process: ServerProcess
    url: str

    def alive(self) -> bool:
        return self.process.proc.poll() is None

    def log(self) -> str:
        with open(self.process.log_path, errors="replace") as f:
            return f.read()

    def greedy_answers(self) -> list[str]:
        """The texts of GREEDY_PROBES, to compare before and after the fuzzing."""
        out = []
        with httpx.Client(base_url=self.url, timeout=120) as c:
            for path, body in GREEDY_PROBES:
                r = c.post(path, json=body)
                assert r.status_code == 200, (path, r.status_code, r.text)
                choice = r.json()["choices"][0]
                out.append(choice["text"] if "text" in choice else choice["message"]["content"])
        return out


def start_server() -> FuzzServer:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = f"{sys.executable} -m jaxllm.server.cli serve --port {port} {SERVER_FLAGS}"
    return FuzzServer(launch_server(command, url, timeout_s=600, env={"JAX_PLATFORMS": "cpu"}), url)


def generated(strategy, n: int) -> list:
    """`n` examples of `strategy`, the same ones on every run (derandomized, no example database)."""
    out: list = []
    if n == 0:
        return out

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x):
        out.append(x)

    try:
        collect()
    except Unsatisfiable:  # fewer distinct examples exist than asked for (a route without parameters)
        pass
    return out


def _runnable_int(v, hi: int) -> bool:
    """A value the server would accept as a count in [1, hi] (so it would run, not refuse)."""
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi


def bounded(path: str, body):
    """`body` with the engine work it asks for capped, everything else as generated: on the generation
    routes a valid max_tokens (or max_completion_tokens) above MAX_GEN_TOKENS is lowered to it, an absent
    one becomes 1, a valid n above MAX_SEQUENCES is lowered (best_of with it), a list of more than
    MAX_SEQUENCES prompts is cut. Values the server refuses (0, negative, huge, wrong types) are kept, so
    the refusals are still fuzzed; only runs get shorter."""
    if path not in GENERATION_ROUTES or not isinstance(body, dict):
        return body
    body = dict(body)
    given_tokens = False
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        given_tokens |= v is not None
        if _runnable_int(v, MAX_MODEL_LEN) and v > MAX_GEN_TOKENS:
            body[name] = MAX_GEN_TOKENS
    if not given_tokens:
        body["max_tokens"] = 1
    n = body.get("n")
    if _runnable_int(n, MAX_N) and n > MAX_SEQUENCES:
        body["n"] = MAX_SEQUENCES
        if body.get("best_of") == n:
            body["best_of"] = MAX_SEQUENCES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_SEQUENCES]
    return body


class Raw(str):
    """JSON text spliced into a body as it is (NaN, 1e999, a 5,000-digit integer, very deep nesting)."""


def to_json(value) -> str:
    """`json.dumps`, with `Raw` pieces spliced in; lone surrogates become \\udXXX escapes (ensure_ascii)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value, allow_nan=True)


@dataclass
class Request:
    """One HTTP request as sent: `content` is the raw body (it may hold NaN, 1e999 or lone surrogates)."""

    method: str
    path: str
    content: bytes | None = None
    headers: dict = field(default_factory=dict)
    params: dict | None = None

    @classmethod
    def json(cls, path: str, body, method: str = "POST") -> Request:
        text = to_json(bounded(path, body))
        return cls(method, path, text.encode(), {"content-type": "application/json"})


def problems(req: Request, status: int, content_type: str, text: str) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500:
        return f"status {status}: {text[:300]}"
    if 400 <= status < 500:
        try:
            body = json.loads(text)
        except ValueError:
            return f"status {status} with a body that is not JSON: {text[:200]!r}"
        err = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)):
            return f"status {status} without the error object: {text[:200]}"
        if set(err) != ERROR_KEYS or not isinstance(err["message"], str) or not err["message"]:
            return f"status {status} with error keys {sorted(err)}: {text[:200]}"
        if not isinstance(err["type"], str) or not all(
            isinstance(err[k], (str, type(None))) for k in ("param", "code")
        ):
            return f"status {status} with wrongly typed error fields: {text[:200]}"
        return None
    if status != 200:
        return f"unexpected status {status}: {text[:200]}"
    if content_type.startswith("text/event-stream"):
        events = [e for e in text.split("\n\n") if e.strip()]
        if not events or events[-1] != "data: [DONE]":
            return f"a stream that does not end with [DONE]: {text[-200:]!r}"
        for e in events[:-1]:
            chunk = json.loads(e.removeprefix("data: "))
            if "error" in chunk:
                return f"a stream with an error event: {e[:300]}"
        return None
    if content_type.startswith("application/json"):
        try:
            json.loads(text)
        except ValueError:
            return f"a 200 whose body is not JSON: {text[:200]!r}"
    return None


@dataclass
class Outcome:
    tried: Counter = field(default_factory=Counter)  # route -> requests sent
    statuses: Counter = field(default_factory=Counter)  # (route, status) -> answers
    failures: list = field(default_factory=list)  # (request, what broke)
    slowest: list = field(default_factory=list)  # (seconds, request), the slowest few

    def report(self, title: str) -> str:
        lines = [f"{title}: {sum(self.tried.values())} requests"]
        for route in sorted(self.tried):
            st = {s: c for (r, s), c in sorted(self.statuses.items()) if r == route}
            lines.append(f"  {route}: {self.tried[route]} tried, statuses {st}")
        lines += [f"  slow: {s:.1f} s {q.path} {(q.content or b'')[:160]!r}" for s, q in self.slowest]
        return "\n".join(lines)


def send_all(url: str, requests: list[Request], concurrency: int = 4, timeout_s: float = 120) -> Outcome:
    out = Outcome()

    def one(client: httpx.Client, req: Request):
        t0 = time.perf_counter()
        try:
            r = client.request(
                req.method, req.path, content=req.content, headers=req.headers, params=req.params
            )
        except httpx.HTTPError as e:
            return req, None, f"no answer: {e!r}", time.perf_counter() - t0
        problem = problems(req, r.status_code, r.headers.get("content-type", ""), r.text)
        return req, r.status_code, problem, time.perf_counter() - t0

    with httpx.Client(base_url=url, timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        for req, status, problem, seconds in pool.map(lambda q: one(client, q), requests):
            out.slowest = sorted([*out.slowest, (seconds, req)], key=lambda x: -x[0])[:5]
            out.tried[req.path] += 1
            out.statuses[(req.path, status)] += 1
            if problem is not None:
                out.failures.append((req, problem))
    return out


def describe(failures: list, limit: int = 10) -> str:
    return "\n".join(
        f"{q.method} {q.path} {(q.content or b'')[:400]!r} params={q.params} -> {p}"
        for q, p in failures[:limit]
    )


def tracebacks(log: str) -> list[str]:
    """The log lines that report an exception the server did not expect (or a log call that failed)."""
    bad = ("Traceback", "--- Logging error ---")
    return [
        ln for ln in log.splitlines() if ln.startswith(("ERROR", "CRITICAL")) or any(b in ln for b in bad)
    ][:10]
