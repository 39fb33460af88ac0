"""Soak: hours of mixed, hostile load on an OpenAI-compatible server, then checks that nothing leaked.

    [--launch "jaxllm serve ..." -> wait for /health]  (or --url of a running server, --server-log its log)
    --concurrency workers, each drawing request kinds at random (KINDS) until --duration-s is over:
        streams and non-streams (completions and chat), n > 1, prompts near max_model_len, streams the
        client drops mid-way, requests the client times out, bad requests (each must get a 4xx)
    --warmup-s of the same mix first, then idle, repeated (up to --warmup-rounds) while a round still
        made the server compile or load programs: the resident memory at the last idle point is the
        baseline (run())
    every --sample-s: /metrics -> running, waiting, KV usage, the server's resident memory
    --> wait for the engine to go idle --> checks (run()) --> JSON result (--out), exit status 1 if any failed

Why our own client and not locust: the checks need each request's exact fate (a stream cut on purpose after
k chunks, a client timeout, a 4xx expected for a bad body, a stream that ended without [DONE]) counted on
the same clock as the server's /metrics; a client on httpx's asyncio API does that in one process with no
other dependency, and is the client the other benchmarks here already use (benchmarks/serve.py).

Every request ends as exactly one outcome: completed, cancelled (the client left on purpose), timed_out
(the client's timeout, on purpose), rejected (a 4xx for a bad request), or a failure: http_error (a 5xx,
or a 4xx for a good request), error_event (an SSE error in a stream), incomplete (no [DONE] or no
finish_reason), transport_error (connection reset, or a timeout nobody asked for). Nothing is left pending:
the driver waits for every task before it counts.

    python -m benchmarks.soak --launch "jaxllm serve --max-model-len 512 --port 8011" \
        --url http://127.0.0.1:8011 --duration-s 3600 --concurrency 32 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.server_process import launch_server

# Request kinds and their weights in the mix.
KINDS = {
    "stream": 4,  # streamed completion, read to [DONE]
    "non_stream_n": 3,  # non-streamed completion with n = 2 or 3
    "chat_stream_n": 2,  # streamed chat with n = 2
    "long_prompt": 2,  # prompt within a few tokens of max_model_len
    "cancel_stream": 3,  # streamed; the client disconnects after a few chunks
    "client_timeout": 1,  # non-streamed, long; the client gives up after a fraction of a second
    "bad_request": 3,  # a body that must be refused with a 4xx
}
FAILURES = ("http_error", "error_event", "incomplete", "transport_error")
OUTCOMES = ("completed", "cancelled", "timed_out", "rejected", *FAILURES)
# A server log line that is a fault: an error, a traceback, an uncaught exception. 4xx answers are logged by
# the access log as INFO lines and are not faults.
LOG_FAULT = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception in ASGI|exception", re.IGNORECASE)


@dataclass
class Tally:
    by_kind: dict = field(default_factory=dict)  # kind -> outcome -> count
    failures: list = field(default_factory=list)  # the first few failures, described

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        counts = self.by_kind.setdefault(kind, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1
        if outcome in FAILURES and len(self.failures) < 50:
            self.failures.append({"kind": kind, "outcome": outcome, "detail": detail[:500]})

    def totals(self) -> dict:
        out = dict.fromkeys(OUTCOMES, 0)
        for counts in self.by_kind.values():
            for k, v in counts.items():
                out[k] += v
        return out


def metric(text: str, name: str) -> float | None:
    """A sample's value summed over its label sets (`name{...} v` or `name v` lines); None when absent."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    ]
    return sum(values) if values else None


async def scrape(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics", timeout=10)).text
    return {
        "t": time.time(),
        "running": metric(text, "vllm:num_requests_running"),
        "waiting": metric(text, "vllm:num_requests_waiting"),
        "kv_usage": metric(text, "vllm:kv_cache_usage_perc"),
        "rss_bytes": metric(text, "process_resident_memory_bytes"),
        # programs the server compiled, loaded or stored so far (every event of its compilation cache)
        "programs": metric(text, "jaxllm:compilation_cache_events_total"),
    }


class Driver:
    def __init__(self, client: httpx.AsyncClient, model: str, max_model_len: int, args, rng: random.Random):
        self.client, self.model, self.max_model_len, self.args, self.rng = (
            client,
            model,
            max_model_len,
            args,
            rng,
        )
        self.tally = Tally()
        self.sent = 0

    def prompt_ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 1000) for _ in range(n)]

    async def one(self, kind: str) -> None:
        self.sent += 1
        try:
            outcome, detail = await getattr(self, f"_{kind}")()
        except httpx.TimeoutException as e:
            outcome, detail = "transport_error", f"unexpected timeout: {e!r}"
        except httpx.TransportError as e:
            outcome, detail = "transport_error", repr(e)
        self.tally.add(kind, outcome, detail)

    async def _read_stream(self, body: dict, route: str, cancel_after: int | None = None) -> tuple[str, str]:
        """Reads an SSE response; `cancel_after`: leave after that many data lines (a disconnect)."""
        finishes, lines = 0, 0
        async with self.client.stream("POST", route, json=body) as r:
            if r.status_code != 200:
                return "http_error", f"{route} stream: {r.status_code} {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                lines += 1
                data = line[6:]
                if data == "[DONE]":
                    want = body.get("n", 1)
                    if finishes < want:
                        return "incomplete", f"{route}: {finishes} finish_reasons of {want} before [DONE]"
                    return "completed", ""
                chunk = json.loads(data)
                if "error" in chunk:
                    return "error_event", json.dumps(chunk)
                finishes += sum(1 for c in chunk.get("choices", ()) if c.get("finish_reason"))
                if cancel_after is not None and lines >= cancel_after:
                    return "cancelled", ""  # leaving the block closes the connection mid-stream
        if cancel_after is not None and finishes >= body.get("n", 1):
            return "completed", ""  # it finished before the client meant to leave
        return "incomplete", f"{route}: the stream ended without [DONE]"

    def _max_tokens(self) -> int:
        return self.rng.randint(1, self.args.max_tokens)

    async def _stream(self):
        body = {"model": self.model, "prompt": self.prompt_ids(self.rng.randint(4, 64)), "stream": True,
                "max_tokens": self._max_tokens(), "temperature": 1.0}  # fmt: skip
        return await self._read_stream(body, "/v1/completions")

    async def _chat_stream_n(self):
        body = {"model": self.model, "messages": [{"role": "user", "content": f"Count to {self.rng.randint(2, 9)}."}],
                "stream": True, "n": 2, "max_tokens": self._max_tokens(), "temperature": 0.8}  # fmt: skip
        return await self._read_stream(body, "/v1/chat/completions")

    async def _cancel_stream(self):
        body = {"model": self.model, "prompt": self.prompt_ids(self.rng.randint(4, 64)), "stream": True,
                "max_tokens": self.args.max_tokens, "ignore_eos": True}  # fmt: skip
        return await self._read_stream(body, "/v1/completions", cancel_after=self.rng.randint(1, 4))

    async def _non_stream(self, body: dict, timeout: float | None = None) -> tuple[str, str]:
        r = await self.client.post(
            "/v1/completions", json=body, timeout=timeout or self.args.request_timeout_s
        )
        if r.status_code != 200:
            return "http_error", f"{r.status_code} {r.text[:300]}"
        choices = r.json().get("choices", [])
        if len(choices) != body.get("n", 1) or not all(c.get("finish_reason") for c in choices):
            return "incomplete", r.text[:300]
        return "completed", ""

    async def _non_stream_n(self):
        body = {"model": self.model, "prompt": self.prompt_ids(self.rng.randint(4, 64)), "n": self.rng.choice((2, 3)),
                "max_tokens": self._max_tokens(), "temperature": 1.0}  # fmt: skip
        return await self._non_stream(body)

    async def _long_prompt(self):
        max_tokens = self.rng.randint(1, 4)
        n = self.max_model_len - max_tokens - self.rng.randint(0, 3)
        body = {"model": self.model, "prompt": self.prompt_ids(n), "max_tokens": max_tokens,
                "stream": self.rng.random() < 0.5}  # fmt: skip
        if body["stream"]:
            return await self._read_stream(body, "/v1/completions")
        return await self._non_stream(body)

    async def _client_timeout(self):
        body = {"model": self.model, "prompt": self.prompt_ids(16), "max_tokens": self.args.max_tokens,
                "ignore_eos": True}  # fmt: skip
        try:
            return await self._non_stream(body, timeout=self.rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            return "timed_out", ""

    async def _bad_request(self):
        ids = self.prompt_ids(4)
        bodies = [
            {"model": self.model, "prompt": ids, "max_tokens": -1},
            {"model": "no-such-model", "prompt": ids, "max_tokens": 2},
            {"model": self.model, "prompt": self.prompt_ids(self.max_model_len + 8), "max_tokens": 2},
            {"model": self.model, "prompt": ids, "max_tokens": 2, "temperature": "hot"},
            {"model": self.model, "prompt": ids, "n": 0},
            {"model": self.model, "messages": "not a list"},
            {"model": self.model, "prompt": ids, "logprobs": 10_000},
        ]
        choice = self.rng.randrange(len(bodies) + 1)
        route = "/v1/chat/completions" if choice == 5 else "/v1/completions"
        if choice == len(bodies):  # not JSON at all
            r = await self.client.post(
                route, content=b"{not json", headers={"content-type": "application/json"}
            )
        else:
            r = await self.client.post(route, json=bodies[choice])
        if 400 <= r.status_code < 500 and "error" in r.json():
            return "rejected", ""
        return "http_error", f"bad request #{choice} answered {r.status_code}: {r.text[:300]}"


async def wait_idle(client: httpx.AsyncClient, timeout_s: float) -> dict:
    """The /metrics sample once nothing runs or waits (or the last one at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = await scrape(client)
        if (s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.5)


def log_faults(log_path: str | None) -> list[str]:
    """Lines of the server log that are faults (LOG_FAULT), the first 50."""
    if not log_path:
        return []
    text = Path(log_path).read_text(errors="replace")
    return [line for line in text.splitlines() if LOG_FAULT.search(line)][:50]


async def load(drv: Driver, duration_s: float, concurrency: int, rng: random.Random, samples, sample_s):
    """`concurrency` workers drawing KINDS until `duration_s` is over (each finishes its last request);
    /metrics read every `sample_s` into `samples`."""
    kinds, weights = list(KINDS), list(KINDS.values())
    t_end = time.monotonic() + duration_s

    async def worker() -> None:
        while time.monotonic() < t_end:
            await drv.one(rng.choices(kinds, weights)[0])

    async def sampler() -> None:
        while time.monotonic() < t_end:
            await asyncio.sleep(sample_s)
            samples.append(await scrape(drv.client))

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))


async def run(args) -> dict:
    """Warm-up (the same mix: the server compiles what the mix needs and its allocators grow), idle, then
    the soak proper, idle again. Resident memory is compared between the two idle points, where no request
    holds memory and no compile is under way, so growth there is memory kept, not a transient."""
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout_s) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        max_model_len = args.max_model_len or models[0].get("max_model_len") or 2048
        start = await wait_idle(client, 60)
        drv = Driver(client, model, max_model_len, args, rng)
        samples = [start]
        # The baseline is taken once the mix stopped meeting programs the server has not made yet: each
        # program kept is legitimate growth, and on a slow machine one round meets fewer of them.
        warmup_rounds, before = 0, start
        while True:
            await load(drv, args.warmup_s, args.concurrency, rng, samples, args.sample_s)
            warm = await wait_idle(client, args.idle_timeout_s)
            samples.append(warm)
            warmup_rounds += 1
            if warmup_rounds >= args.warmup_rounds or warm["programs"] in (None, before["programs"]):
                break
            before = warm
        t0 = time.monotonic()
        await load(drv, args.duration_s, args.concurrency, rng, samples, args.sample_s)
        load_s = time.monotonic() - t0
        end = await wait_idle(client, args.idle_timeout_s)
        samples.append(end)
        health = (await client.get("/health")).status_code
    totals = drv.tally.totals()
    growth = None if warm["rss_bytes"] is None else end["rss_bytes"] - warm["rss_bytes"]
    faults = log_faults(args.server_log)
    checks = {
        "every_request_accounted": sum(totals.values()) == drv.sent,
        "no_failures": all(totals[f] == 0 for f in FAILURES),
        "each_kind_ran": all(sum(drv.tally.by_kind.get(k, {}).values()) > 0 for k in KINDS),
        "idle_after": end["running"] == 0 and end["waiting"] == 0,
        "kv_blocks_back": end["kv_usage"] == start["kv_usage"] == 0,
        "rss_flat": growth is not None and growth <= args.max_rss_growth_mib * 2**20,
        "no_log_faults": not faults,
        "healthy_after": health == 200,
    }
    mib = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
    return {
        "url": args.url,
        "model": model,
        "max_model_len": max_model_len,
        "warmup_s": args.warmup_s,
        "warmup_rounds": warmup_rounds,
        "duration_s": round(load_s, 1),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "requests": drv.sent,
        "outcomes": totals,
        "by_kind": drv.tally.by_kind,
        "failures": drv.tally.failures,
        "metrics_start": start,
        "metrics_warm": warm,
        "metrics_end": end,
        "rss_warm_idle_mib": mib(warm["rss_bytes"]),
        "rss_end_idle_mib": mib(end["rss_bytes"]),
        "rss_growth_mib": mib(growth),
        "programs_made_in_soak": None
        if end["programs"] is None or warm["programs"] is None
        else end["programs"] - warm["programs"],
        "rss_peak_mib": mib(max((s["rss_bytes"] or 0) for s in samples)),
        "max_rss_growth_mib": args.max_rss_growth_mib,
        "rss_samples_mib": [mib(s["rss_bytes"]) for s in samples if s["rss_bytes"]],
        "log_faults": faults,
        "checks": checks,
        "passed": all(checks.values()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (also where --launch serves)")
    p.add_argument(
        "--launch", help="a server command to start first (and stop at the end); its log is checked"
    )
    p.add_argument("--server-log", help="with --url alone: the server's log file, checked for faults")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of the generated requests")
    p.add_argument("--model", help="default: the server's first model")
    p.add_argument("--max-model-len", type=int, help="default: what /v1/models says")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="seconds of the same mix before the soak proper (not in its figures, but checked)",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=3,
        help="most warm-up rounds: another follows while the last one made the server compile or load "
        "programs (jaxllm:compilation_cache_events)",
    )
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=256.0,
        help="most the server's resident memory may grow between the idle point after the warm-up and the "
        "idle point at the end",
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="how often /metrics is read")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="the client's timeout for others")
    p.add_argument("--idle-timeout-s", type=float, default=120.0, help="most the engine may take to go idle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the JSON result (default: printed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.launch:
        server = launch_server(args.launch, args.url)
        args.server_log = args.server_log or server.log_path
    try:
        result = asyncio.run(run(args))
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    summary = {k: result[k] for k in ("requests", "outcomes", "rss_growth_mib", "checks", "passed")}
    print(json.dumps(summary, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
