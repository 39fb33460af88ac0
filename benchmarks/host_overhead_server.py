"""The real server (Starlette app + AsyncLLMEngine) over an engine whose step only waits: the host cost of
serving, with the device's time as a known bound.

    python -m benchmarks.host_overhead_server --device-ms 6 --port 8011 &
    python -m benchmarks.serve --base-url http://127.0.0.1:8011 --shape-model tiny-llama \
        --num-prompts 64 --input-len 16 --output-len 64 --sweep-concurrency 1,32

`DeviceTimeEngine.step()` waits for its previous step's `--device-ms` without the GIL (as a step waiting on
the GPU does), around `--host-ms` of pure-Python work (the engine's scheduling and output processing,
GIL held, as LLMEngine.step does with async scheduling), and gives every running request one more token.
`--switch-interval-ms` sets the interpreter's GIL switch interval, to see whether the step thread waits
on the event loop's thread for the GIL. The measured TPOT minus the step's device time is what the
server's host path (engine loop, streams, SSE, HTTP) adds per token at that concurrency; set
`--device-ms` to a real card's decode step (step_profile.py) to see it against a real device.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

from jaxllm.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from jaxllm.sampling_params import RequestOutputKind  # noqa: E402
from jaxllm.stats import EngineStats  # noqa: E402

TOKEN = 7


class DeviceTimeEngine:
    """The LLMEngine surface AsyncLLMEngine and the server use; no model. `step()` waits `device_s`, then
    emits one token (id 7) per running request until its max_tokens."""

    def __init__(self, device_s: float, vocab_size: int, max_model_len: int, name: str, host_s: float = 0.0):
        self.device_s = device_s
        self.host_s = host_s
        self._device_free = 0.0  # when the step in flight ends (perf_counter seconds)
        self.tokenizer = None
        self.sampling_defaults = {}
        self.loaded = SimpleNamespace(model_name=name, arch=SimpleNamespace(vocab_size=vocab_size))
        self.max_model_len = max_model_len
        self.startup_info = {"model": name, "device_ms": device_s * 1e3}
        self.last_step_tokens = 0
        self.running: dict[str, SimpleNamespace] = {}
        self.generated = 0

    def prepare_request(self, request_id, prompt, params, priority=0):
        ids = list(prompt) if not isinstance(prompt, str) else [1]
        return SimpleNamespace(
            request_id=request_id, prompt_ids=ids, params=params, out=[], arrival=time.monotonic()
        )

    def enqueue(self, parent) -> None:
        self.running[parent.request_id] = parent

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def get_stats(self) -> EngineStats:
        return EngineStats(num_requests_running=len(self.running), generation_tokens=self.generated)

    def step(self) -> list[RequestOutput]:
        # As LLMEngine.step with async scheduling: host work (GIL held) schedules and dispatches the next
        # step, the thread waits for the step in flight without the GIL, then host work processes it.
        _busy(self.host_s / 2)
        now = time.perf_counter()
        done, self._device_free = self._device_free, max(self._device_free, now) + self.device_s
        if done > now:
            time.sleep(done - now)
        _busy(self.host_s / 2)
        outs = []
        now = time.monotonic()
        for rid, r in list(self.running.items()):
            r.out.append(TOKEN)
            r.first = getattr(r, "first", None) or now
            done = len(r.out) >= r.params.max_tokens
            if done:
                del self.running[rid]
            # What LLMEngine hands out for each output kind: the new token (DELTA, the server's streams),
            # one output at the end (FINAL_ONLY), or everything so far (CUMULATIVE).
            kind = r.params.output_kind
            if kind is RequestOutputKind.FINAL_ONLY and not done:
                continue
            ids = [TOKEN] if kind is RequestOutputKind.DELTA else list(r.out)
            reason = "length" if done else None
            completion = CompletionOutput(0, " x" * len(ids), ids, finish_reason=reason)
            metrics = RequestMetrics(r.arrival, first_token_time=r.first, last_token_time=now)
            outs.append(RequestOutput(rid, None, r.prompt_ids, [completion], done, metrics=metrics))
        self.last_step_tokens = len(self.running) + sum(o.finished for o in outs)  # one per request
        self.generated += self.last_step_tokens
        return outs


def _busy(seconds: float) -> None:
    """Pure-Python work for `seconds`, holding the GIL as the engine's host code does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-ms", type=float, default=6.0)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--model-name", default="tiny-llama")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--loop", default="auto", help="uvicorn's event loop: auto (uvloop if installed), asyncio, uvloop"
    )
    p.add_argument(
        "--http", default="auto", help="uvicorn's HTTP parser: auto (httptools if installed), h11, httptools"
    )
    p.add_argument("--host-ms", type=float, default=0.0, help="engine host work per step, GIL held")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval (Python's default: 5 ms)",
    )
    args = p.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    import uvicorn

    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.server.app import build_app

    inner = DeviceTimeEngine(
        args.device_ms / 1e3, args.vocab_size, args.max_model_len, args.model_name, host_s=args.host_ms / 1e3
    )
    app = build_app(AsyncLLMEngine(inner))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop=args.loop, http=args.http)


if __name__ == "__main__":
    main()
