"""Serving with part of the requests under a JSON schema: what constrained decoding costs the batch.

    python -m benchmarks.structured_serving --byte-level-tokenizer DIR \
        --launch "jaxllm serve llama-3.1-8b --load-format dummy --tokenizer DIR --port 8000" \
        --concurrency 32 --num-prompts 256 --structured-fraction 0.5 --output-json FILE

    [in-process: jaxllm.structured_output compiles each schema, cold and cached, if this checkout has it]
    [--launch: the server, timed to /health]
    probe: one free and one constrained request (a server that refuses structured_outputs stops here)
    warm-up: --warmup-prompts requests, as mixed as the timed run (device code for masked rows compiles)
    compile probe, idle server, one request at a time, short prompts: per schema, a request with the
        schema never seen, then three with it again, then a free one: compile ~ TTFT(new) - TTFT(cached)
    three timed runs at --concurrency, each on fresh random prompts (no prefix hits):
      free:    every request free (ignore_eos, --output-len tokens)
      mixed:   --structured-fraction of them (interleaved) carry "structured_outputs": {"json": schema}
               (vLLM's field), cycling over the schemas under a title new to the server, so the first
               request of each schema compiles it and later ones hit the cache; no ignore_eos, the same
               max_tokens: a constrained request ends when its JSON closes
      matched: the mixed run without constraints: each request that was constrained is free with
               max_tokens = the tokens it produced (ignore_eos), so the two runs have the same prefill
               and decode lengths and differ only in the grammar
    -> median / p99 TPOT per run and per group (free, constrained), output tok/s, the TPOT ratios
       mixed/matched (the same run unconstrained: the target, within 10%) and mixed/free; constrained
       outputs checked against their schema (jsonschema when installed, else json.loads); grammar
       compile per new schema from the probe, from the mixed run (TTFT of each schema's first request
       minus the median TTFT of cached-schema requests), and from the server's /metrics where it has
       grammar or structured-output series

Random-weight presets have no tokenizer, and the word-level one of server_process.py spells no "{":
--byte-level-tokenizer writes benchmarks/byte_level_tokenizer.py's of the shape model's vocabulary.
TPOT is compared, not E2E: constrained requests stop early by design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.byte_level_tokenizer import write_byte_level_tokenizer
from benchmarks.finished import exit_on_incomplete, require_all_finished
from benchmarks.grammar_cases import SERVING_SCHEMAS, with_variant
from benchmarks.serve import _stop_on_sigterm, model_from_launch, run_load, served_model
from benchmarks.serve_metrics import RequestTiming, serving_metrics
from benchmarks.server_process import flag_value, launch_server, wait_for_background_compiles
from benchmarks.workload import (
    BenchRequest,
    hf_config_for_model,
    make_result,
    random_requests,
    save_result,
)

RUNS = ("free", "mixed", "matched")
PROBE_PROMPT_LEN = 16
PROBE_CACHED = 3
TPOT_TARGET = 1.10  # the mixed run's median TPOT at most 10% above the same run unconstrained


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serving with a fraction of requests under JSON schemas.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", default=None, help='start this server command first ("jaxllm serve ...")')
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--server-log", default=None)
    p.add_argument("--model", default=None, help="model name to send; default: the first of /v1/models")
    p.add_argument("--shape-model", default=None, help="preset or HF folder (vocabulary, bos, eos)")
    p.add_argument(
        "--byte-level-tokenizer",
        default=None,
        metavar="DIR",
        help="write a byte-level tokenizer of the shape model's vocabulary to DIR first (pass --tokenizer "
        "DIR in --launch)",
    )
    p.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--structured-fraction", type=float, default=0.5)
    p.add_argument(
        "--json-schema",
        default="builtin",
        help="builtin (grammar_cases.SERVING_SCHEMAS) or a JSON file holding a schema or a list of them",
    )
    p.add_argument("--num-schemas", type=int, default=8, help="distinct schemas the constrained requests use")
    p.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="send structured_outputs.disable_any_whitespace (compact JSON)",
    )
    p.add_argument("--warmup-prompts", type=int, default=32)
    p.add_argument("--compile-wait-s", type=float, default=180.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


# ---- schemas and requests ------------------------------------------------------------------------------
def load_schemas(spec: str, count: int) -> list[dict[str, Any]]:
    if count < 1:
        raise ValueError(f"--num-schemas={count} must be >= 1")
    if spec == "builtin":
        pool = [c.schema for c in SERVING_SCHEMAS]
    else:
        with open(spec) as f:
            loaded = json.load(f)
        pool = loaded if isinstance(loaded, list) else [loaded]
        if not pool or not all(isinstance(s, dict) for s in pool):
            raise ValueError(f"--json-schema {spec}: expected a JSON schema object or a list of them")
    # More schemas than the pool holds: the pool again under other titles (new to a cache all the same).
    return [pool[k] if k < len(pool) else with_variant(pool[k % len(pool)], f"copy{k}") for k in range(count)]


def constrained_indices(n: int, fraction: float) -> list[int]:
    """Which of n requests carry a schema: spread evenly (fraction 0.5: every second one, from index 1)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--structured-fraction={fraction} must be in [0, 1]")
    return [i for i in range(n) if math.floor((i + 1) * fraction) > math.floor(i * fraction)]


def structured_body(schema: dict[str, Any], compact: bool) -> dict[str, Any]:
    so: dict[str, Any] = {"json": schema}
    if compact:
        so["disable_any_whitespace"] = True
    return {"ignore_eos": False, "structured_outputs": so}


def mixed_requests(
    base: list[BenchRequest], schemas: list[dict[str, Any]], fraction: float, tag: str, compact: bool
) -> tuple[list[BenchRequest], dict[int, int]]:
    """The run's requests and, for each constrained one, the index of its schema. Every schema is sent
    under the title `tag`, so the first request of each is the server's first sight of it."""
    variants = [with_variant(s, tag) for s in schemas]
    schema_of: dict[int, int] = {}
    out = list(base)
    for k, i in enumerate(constrained_indices(len(base), fraction)):
        schema_of[i] = k % len(schemas)
        r = base[i]
        out[i] = BenchRequest(
            r.prompt, r.input_len, r.output_len, structured_body(variants[k % len(schemas)], compact)
        )
    return out, schema_of


def matched_requests(base: list[BenchRequest], mixed: list[RequestTiming], schema_of: dict[int, int]):
    """Free requests of the lengths the mixed run produced: a constrained one's output becomes max_tokens."""
    out = []
    for i, r in enumerate(base):
        n = r.output_len
        if i in schema_of and mixed[i].success and mixed[i].output_tokens > 0:
            n = mixed[i].output_tokens
        out.append(BenchRequest(r.prompt, r.input_len, n))
    return out


# ---- checks and estimates ------------------------------------------------------------------------------
def check_output(t: RequestTiming, schema: dict[str, Any]) -> str:
    """'valid', 'invalid' (ended but not a document of the schema), 'truncated' (max_tokens) or 'failed'."""
    if not t.success:
        return "failed"
    if t.finish_reason == "length":
        return "truncated"
    try:
        doc = json.loads(t.text)
    except json.JSONDecodeError:
        return "invalid"
    try:
        import jsonschema
    except ImportError:
        return "valid"  # parsed as JSON; without jsonschema the schema itself is not checked
    return "valid" if jsonschema.Draft202012Validator(schema).is_valid(doc) else "invalid"


def structured_summary(timings, schema_of: dict[int, int], schemas) -> dict[str, Any]:
    outcomes = {i: check_output(timings[i], schemas[k]) for i, k in schema_of.items()}
    counts = {
        o: sum(1 for v in outcomes.values() if v == o) for o in ("valid", "invalid", "truncated", "failed")
    }
    tokens = [timings[i].output_tokens for i in schema_of if timings[i].success]
    try:
        import jsonschema  # noqa: F401

        checked_with = "jsonschema"
    except ImportError:
        checked_with = "json.loads only (jsonschema is not installed)"
    honoured = counts["valid"] > 0 and counts["invalid"] == 0 if schema_of else None
    summary = {
        "requests": len(schema_of),
        **counts,
        "checked_with": checked_with,
        "honoured": honoured,
        "mean_output_tokens": float(np.mean(tokens)) if tokens else None,
        "examples": [timings[i].text[:300] for i in list(schema_of)[:3]],
    }
    if honoured is False:
        summary["warning"] = (
            f"the server did not honour structured_outputs: {counts['valid']} of {len(schema_of)} constrained "
            f"outputs were documents of their schema ({counts['invalid']} ended as something else, "
            f"{counts['truncated']} hit max_tokens)"
        )
    return summary


def in_run_compile_estimate(timings, schema_of: dict[int, int]) -> dict[str, Any]:
    """TTFT of each schema's first request minus the median TTFT of the constrained requests whose schema
    the server had already seen (all of the same run, so under the same load)."""
    first: dict[int, int] = {}
    for i in sorted(schema_of):
        first.setdefault(schema_of[i], i)
    cached = [timings[i].ttft for i in schema_of if i not in first.values() and timings[i].success]
    if not cached:
        return {"per_schema_ms": [], "median_ms": None, "cached_ttft_median_ms": None}
    base = float(np.median(cached))
    per = [(timings[i].ttft - base) * 1e3 for k, i in sorted(first.items()) if timings[i].success]
    return {
        "per_schema_ms": [round(x, 2) for x in per],
        "median_ms": round(float(np.median(per)), 2) if per else None,
        "cached_ttft_median_ms": round(base * 1e3, 2),
    }


def probe_requests(
    schemas, vocab: int, seed: int, tag: str, compact: bool
) -> list[tuple[int, str, BenchRequest]]:
    """(schema index, 'new' | 'cached' | 'free', request) in the order they are sent, one at a time."""
    prompts = random_requests(len(schemas) * (PROBE_CACHED + 2), PROBE_PROMPT_LEN, 2, vocab, 0.0, seed)
    out, it = [], iter(prompts)
    for k, s in enumerate(schemas):
        body = structured_body(with_variant(s, tag), compact)
        body["ignore_eos"] = True  # two tokens either way: only the first one's time matters here
        for role in ("new", *["cached"] * PROBE_CACHED, "free"):
            r = next(it)
            out.append((k, role, BenchRequest(r.prompt, r.input_len, 2, None if role == "free" else body)))
    return out


def probe_compile_estimate(plan, timings: list[RequestTiming]) -> dict[str, Any]:
    rows = []
    for k in sorted({k for k, _, _ in plan}):
        ttft = {role: [t.ttft * 1e3 for (kk, rr, _), t in zip(plan, timings, strict=True) if kk == k and rr == role and t.success]
                for role in ("new", "cached", "free")}  # fmt: skip
        if not ttft["new"] or not ttft["cached"]:
            rows.append({"schema": k, "error": "a probe request failed"})
            continue
        cached = float(np.median(ttft["cached"]))
        rows.append(
            {
                "schema": k,
                "ttft_new_ms": round(ttft["new"][0], 2),
                "ttft_cached_ms": round(cached, 2),
                "ttft_free_ms": round(ttft["free"][0], 2) if ttft["free"] else None,
                "compile_ms": round(ttft["new"][0] - cached, 2),
            }
        )
    est = [r["compile_ms"] for r in rows if "compile_ms" in r]
    return {"per_schema": rows, "median_compile_ms": round(float(np.median(est)), 2) if est else None}


def in_process_compile(schemas, tokenizer_dir: str | None, vocab: int | None, tag: str) -> dict[str, Any]:
    """jaxllm's own grammar compiler on each schema, cold and again (its cache), in this process."""
    from jaxllm.sampling_params import StructuredOutputsParams
    from jaxllm.structured_output import GrammarCompiler

    if tokenizer_dir is None or vocab is None:
        return {"status": "not measured: no tokenizer folder (pass --byte-level-tokenizer or --tokenizer)"}
    from jaxllm.tokenizer import load_tokenizer

    try:
        t0 = time.perf_counter()
        compiler = GrammarCompiler(load_tokenizer(tokenizer_dir), vocab)
        setup = time.perf_counter() - t0
        # The first compile also prepares the tokenizer for the grammar engine (once per server): apart.
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json={"type": "string", "title": f"warmup-{tag}"}))
        first = time.perf_counter() - t0
        rows = []
        for k, s in enumerate(schemas):
            schema = with_variant(s, f"inproc-{tag}")
            times = []
            for _ in range(2):  # a new params object each time, as each request brings its own
                t0 = time.perf_counter()
                compiler.compile(StructuredOutputsParams(json=schema))
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append({"schema": k, "cold_ms": round(times[0], 3), "again_ms": round(times[1], 3)})
    except Exception as e:  # a failed measurement is reported; the serving runs still go ahead
        return {"status": f"failed: {type(e).__name__}: {e}"}
    return {
        "status": "ok",
        "setup_ms": round(setup * 1e3, 1),
        "first_compile_ms": round(first * 1e3, 1),
        "per_schema": rows,
        "median_cold_ms": round(float(np.median([r["cold_ms"] for r in rows])), 3),
        "median_again_ms": round(float(np.median([r["again_ms"] for r in rows])), 3),
    }


def scrape_metrics(base_url: str, wanted) -> dict[str, float] | None:
    """The /metrics samples whose lower-cased name `wanted` accepts (None: no /metrics)."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0].lower()
        if wanted(name) and not name.endswith("_created"):
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def grammar_metrics(base_url: str) -> dict[str, float] | None:
    """Every /metrics sample whose name speaks of grammars or structured outputs (names differ by server)."""
    return scrape_metrics(base_url, lambda name: "grammar" in name or "structured" in name)


def step_metrics(base_url: str) -> dict[str, float] | None:
    """jaxllm's step counters: steps, the step thread's device wait and its host time by phase."""
    return scrape_metrics(base_url, lambda name: name.startswith(("jaxllm:engine_steps", "jaxllm:step_")))


def per_step_ms(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Milliseconds per engine step over a run, of the device wait and of each host phase (jaxllm only)."""
    if not before or not after:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    steps = next((v for k, v in delta.items() if k.startswith("jaxllm:engine_steps")), 0.0)
    if steps <= 0:
        return None
    out = {"steps": steps}
    for key, v in delta.items():
        name, _, labels = key.partition("{")
        if name.startswith("jaxllm:step_device_wait"):
            out["device_wait_ms"] = round(1e3 * v / steps, 4)
        elif name.startswith("jaxllm:step_host") and 'phase="' in labels:
            phase = labels.split('phase="', 1)[1].split('"', 1)[0]
            out[f"{phase}_ms"] = round(1e3 * v / steps, 4)
    return out


def metrics_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    delta = {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if v != before.get(k, 0.0)}
    # A histogram's mean over the run: <name>_sum / <name>_count with the same labels.
    means = {}
    for k, v in delta.items():
        name, brace, labels = k.partition("{")
        if name.endswith("_sum"):
            count = delta.get(name[: -len("_sum")] + "_count" + brace + labels)
            if count:
                means[name[: -len("_sum")] + brace + labels] = v / count
    return {"delta": delta, "histogram_means": means}


# ---- the run --------------------------------------------------------------------------------------------
def group_metrics(timings, indices, duration: float) -> dict[str, Any] | None:
    group = [timings[i] for i in indices]
    return serving_metrics(group, duration) if group else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def summary_table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| run | requests ok | median TPOT ms | p99 TPOT ms | median TTFT ms | output tok/s | "
        "free rows: median TPOT | constrained rows: median TPOT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        m, g = r["metrics"], r.get("groups") or {}
        cells = []
        for key in ("free", "constrained"):
            gm = g.get(key)
            cells.append(f"{gm['median_tpot_ms']:.2f}" if gm else "-")
        lines.append(
            f"| {name} | {m['completed']}/{m['completed'] + m['failed']} | {m['median_tpot_ms']:.2f} | "
            f"{m['p99_tpot_ms']:.2f} | {m['median_ttft_ms']:.1f} | {m['output_throughput']:,.1f} | "
            f"{cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    schemas = load_schemas(args.json_schema, args.num_schemas)
    constrained = constrained_indices(args.num_prompts, args.structured_fraction)
    shape_name = args.shape_model or model_from_launch(args.launch) or args.model
    if shape_name is None:
        raise ValueError("the model's shape is unknown: pass --shape-model (a preset or HF folder)")
    cfg = hf_config_for_model(shape_name)
    vocab = int(cfg["vocab_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos or 0])]
    if args.byte_level_tokenizer:
        write_byte_level_tokenizer(
            args.byte_level_tokenizer, vocab, int(cfg.get("bos_token_id") or 0), eos_ids
        )
    tag = uuid.uuid4().hex[:8]  # titles no earlier run against this server used
    tokenizer_dir = args.byte_level_tokenizer or flag_value(args.launch, "--tokenizer")
    inproc = in_process_compile(schemas, tokenizer_dir, vocab, tag)
    print(f"in-process compile: {inproc.get('status')}", inproc.get("median_cold_ms", ""))

    server, ready_s = None, None
    if args.launch:
        server = launch_server(args.launch, args.base_url, args.launch_timeout, log_path=args.server_log)
        ready_s = server.ready_s
        print(f"server ready in {ready_s:.1f} s (log: {server.log_path})")
    try:
        model = args.model or served_model(args.base_url)

        def load(reqs: list[BenchRequest], conc: int):
            return asyncio.run(
                run_load(
                    args.base_url,
                    model,
                    reqs,
                    math.inf,
                    conc,
                    args.temperature,
                    args.seed,
                    args.request_timeout,
                )
            )

        first = random_requests(2, 8, 4, vocab, 0.0, args.seed + 100)
        probe_body = structured_body(with_variant(schemas[0], f"first-{tag}"), args.disable_any_whitespace)
        (free_t, so_t), _ = load([first[0], BenchRequest(first[1].prompt, 8, 4, probe_body)], 1)
        if not free_t.success:
            raise RuntimeError(f"the first request failed: {free_t.error}")
        if not so_t.success:
            raise RuntimeError(
                f"a request with structured_outputs failed (does the server serve them?): {so_t.error}"
            )
        if args.warmup_prompts:
            # Mixed as the timed run is: a batch with masked rows may take device code of its own, which
            # must be compiled before the timing starts, not in the first timed steps.
            warm, _ = mixed_requests(
                random_requests(
                    args.warmup_prompts, args.input_len, args.output_len, vocab, 0.0, args.seed + 200
                ),
                schemas,
                args.structured_fraction,
                f"warmup-{tag}",
                args.disable_any_whitespace,
            )
            _, secs = load(warm, args.concurrency)
            print(f"warm-up: {len(warm)} requests in {secs:.1f} s (not counted)")
        waited = None
        if args.compile_wait_s > 0:
            status = wait_for_background_compiles(args.base_url, args.compile_wait_s)
            waited = None if status is None else status[0]

        plan = probe_requests(schemas, vocab, args.seed + 300, f"probe-{tag}", args.disable_any_whitespace)
        probe_t, _ = load([r for _, _, r in plan], 1)
        probe = probe_compile_estimate(plan, probe_t)
        print(f"compile probe (idle server): median {probe['median_compile_ms']} ms per new schema")

        runs: dict[str, dict[str, Any]] = {}
        n = args.num_prompts
        base = {
            name: random_requests(n, args.input_len, args.output_len, vocab, 0.0, args.seed + k)
            for k, name in enumerate(RUNS)
        }
        steps0 = step_metrics(args.base_url)
        free_t, free_s = load(base["free"], args.concurrency)
        steps1 = step_metrics(args.base_url)
        runs["free"] = {"metrics": serving_metrics(free_t, free_s), "per_step": per_step_ms(steps0, steps1)}
        reqs, schema_of = mixed_requests(
            base["mixed"], schemas, args.structured_fraction, f"run-{tag}", args.disable_any_whitespace
        )
        before = grammar_metrics(args.base_url)
        steps0 = step_metrics(args.base_url)
        mixed_t, mixed_s = load(reqs, args.concurrency)
        steps1 = step_metrics(args.base_url)
        server_metrics = metrics_delta(before, grammar_metrics(args.base_url))
        free_rows = [i for i in range(n) if i not in schema_of]
        runs["mixed"] = {
            "metrics": serving_metrics(mixed_t, mixed_s),
            "per_step": per_step_ms(steps0, steps1),
            "groups": {
                "free": group_metrics(mixed_t, free_rows, mixed_s),
                "constrained": group_metrics(mixed_t, constrained, mixed_s),
            },
        }
        steps0 = step_metrics(args.base_url)
        matched_t, matched_s = load(matched_requests(base["matched"], mixed_t, schema_of), args.concurrency)
        steps1 = step_metrics(args.base_url)
        runs["matched"] = {
            "metrics": serving_metrics(matched_t, matched_s),
            "per_step": per_step_ms(steps0, steps1),
            "groups": {
                "free": group_metrics(matched_t, free_rows, matched_s),
                "constrained": group_metrics(matched_t, constrained, matched_s),
            },
        }
    finally:
        if server is not None:
            server.stop()
    for run_name, r in runs.items():  # no figures from a run that lost requests
        require_all_finished(
            f"structured_serving run {run_name}",
            r["metrics"]["completed"],
            r["metrics"]["completed"] + r["metrics"]["failed"],
        )

    for name, ts in (("free", free_t), ("mixed", mixed_t), ("matched", matched_t)):
        runs[name]["errors"] = sorted({t.error for t in ts if not t.success})[:5]
    med = {k: runs[k]["metrics"]["median_tpot_ms"] for k in RUNS}
    tpot = {
        "mixed_vs_matched": ratio(med["mixed"], med["matched"]),
        "mixed_vs_free": ratio(med["mixed"], med["free"]),
        "p99_mixed_vs_matched": ratio(
            runs["mixed"]["metrics"]["p99_tpot_ms"], runs["matched"]["metrics"]["p99_tpot_ms"]
        ),
        "free_rows_mixed_vs_matched": ratio(
            (runs["mixed"]["groups"]["free"] or {}).get("median_tpot_ms"),
            (runs["matched"]["groups"]["free"] or {}).get("median_tpot_ms"),
        ),
        "target": TPOT_TARGET,
    }
    tpot["target_met"] = None if tpot["mixed_vs_matched"] is None else tpot["mixed_vs_matched"] <= TPOT_TARGET
    structured = structured_summary(mixed_t, schema_of, schemas)
    table = summary_table(runs)
    results = {
        "runs": runs,
        "tpot_ratio": tpot,
        "structured": structured,
        "compile": {
            "probe": probe,
            "in_run": in_run_compile_estimate(mixed_t, schema_of),
            "server_metrics": server_metrics,
            "in_process": inproc,
        },
        "table": table,
        "schema_tag": tag,
    }
    name = args.name or f"structured-serving-{Path(str(shape_name)).name}-c{args.concurrency}"
    result = make_result(
        "structured-serving",
        name,
        shape_name,
        vars(args),
        results,
        None,
        server_ready_s=ready_s,
        background_compile_wait_s=waited,
    )
    print(table)
    print(
        f"median TPOT mixed/matched {tpot['mixed_vs_matched']:.3f} (target <= {TPOT_TARGET}), "
        f"mixed/free {tpot['mixed_vs_free']:.3f}; constrained outputs: {structured['valid']} valid, "
        f"{structured['invalid']} invalid, {structured['truncated']} truncated of {structured['requests']}"
    )
    if "warning" in structured:
        print("WARNING: " + structured["warning"])
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    import logging

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    exit_on_incomplete(main)
