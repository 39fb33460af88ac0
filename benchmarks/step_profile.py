"""Where one engine step's time goes: the device kernels of a traced step, summed and sorted.

    LLM(model, dummy weights) -> its ModelRunner -> a step's packed inputs (decode-only: b sequences at
    context c; or mixed: b decodes plus p prefill chunks of n tokens) -> warm-up -> `jax.profiler` trace
    of `reps` steps -> the trace's device events (per kernel name: calls, total time) -> per step:
    wall time, busy time (sum of kernels), the idle share, and time by kind (matmul, attention,
    KV write, XLA fusions, copies, other). Untraced, the same step also runs `reps` times back to back
    (the engine's overlapped loop): the time per step of that train and the host's time to enqueue one.

    python -m benchmarks.step_profile --model llama-3.1-8b --decode 256x640 --decode 32x640 --mixed 200x640+4x512

The busy time against the wall time says whether the step waits on launches (gaps between kernels) or
on the kernels themselves; the kinds say which kernels. A decode case also carries its bandwidth bound
(the weights plus every context token's K and V read once, at the card's peak: roofline.py) and the share
of it the busy time and the back-to-back step reach. Only device (GPU) events are counted; on the CPU
there are none and the report says so.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.decode_step import decode_inputs, randomize_kv
from benchmarks.roofline import HARDWARE_CHOICES, decode_step_seconds, kernel_hardware, shape_for_model
from benchmarks.workload import make_result, save_result
from jaxllm.config import ATTENTION_BACKENDS

logger = logging.getLogger("jaxllm.benchmarks")

# First match wins; names are the device kernels' names (cuBLAS/CUTLASS, Triton/Mosaic, XLA fusions).
KINDS = (
    ("matmul", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|wgmma|matmul|dot", re.I)),
    ("attention", re.compile(r"ragged|paged|attention|rpa|mgpu|flash", re.I)),
    ("kv_write", re.compile(r"kv_cache|write_kv|scatter", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|transpose|concatenate|convert", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if pat.search(name):
            return kind
    return "other"


def _line_names(trace: dict) -> tuple[dict, dict]:
    """({pid: process name}, {(pid, tid): thread name}) from a Chrome trace's metadata events."""
    procs, threads = {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    return procs, threads


def _stream_kernels(trace: dict):
    """The X events of the GPU's stream lines: its kernels and copies. The "XLA Ops" / "XLA Modules" lines
    repeat the same time under HLO names and are left out."""
    procs, threads = _line_names(trace)
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "/device:GPU" not in procs.get(e.get("pid"), ""):
            continue
        if threads.get((e["pid"], e.get("tid")), "").lower().startswith("stream"):
            yield e


def device_lines(trace: dict) -> dict[str, int]:
    """{"process / thread": events} of the device's lines in a Chrome trace (what the counts rest on)."""
    procs, threads = _line_names(trace)
    out: collections.Counter = collections.Counter()
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "/device:" in procs.get(e.get("pid"), ""):
            out[f"{procs[e['pid']]} / {threads.get((e['pid'], e.get('tid')), '?')}"] += 1
    return dict(out)


def host_event_times(trace: dict) -> dict[str, tuple[int, float]]:
    """{event name: (calls, total microseconds)} over the host's lines (XLA's and PjRt's TraceMe events:
    the executable's launch, its thunks, allocations, transfers). Nested events each count their whole
    duration."""
    procs, _ = _line_names(trace)
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "/device:" in procs.get(e.get("pid"), ""):
            continue
        rec = out[e["name"]]
        rec[0] += 1
        rec[1] += float(e.get("dur", 0.0))
    return {k: (v[0], v[1]) for k, v in out.items()}


def device_kernel_times(trace: dict) -> dict[str, tuple[int, float]]:
    """{kernel name: (calls, total microseconds)} over the device's stream lines of a Chrome trace."""
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in _stream_kernels(trace):
        rec = out[e["name"]]
        rec[0] += 1
        rec[1] += float(e.get("dur", 0.0))
    return {k: (v[0], v[1]) for k, v in out.items()}


def device_spans(trace: dict, gap_us: float = 300.0) -> list[tuple[float, float]]:
    """(span, busy) in microseconds of each burst of device kernels: kernels closer than `gap_us` belong
    to one step. span - busy is the time the device sat between kernels inside a step (launch gaps);
    the step's wall time beyond span is the host's (dispatch, copies in, the wait)."""
    evs = sorted((float(e["ts"]), float(e.get("dur", 0.0))) for e in _stream_kernels(trace))
    out, start, end, busy = [], None, None, 0.0
    for ts, dur in evs:
        if start is not None and ts - end > gap_us:
            out.append((end - start, busy))
            start = None
        if start is None:
            start, end, busy = ts, ts, 0.0
        end, busy = max(end, ts + dur), busy + dur
    if start is not None:
        out.append((end - start, busy))
    return out


def kernel_sequence(trace: dict, limit: int) -> list[dict]:
    """The first `limit` kernels of the trace's last step (last burst), in device order: name, duration
    and the idle time since the previous kernel ended (us). Shows what one layer launches, one by one."""
    evs = sorted((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]) for e in _stream_kernels(trace))
    start = 0
    for i in range(1, len(evs)):
        if evs[i][0] - (evs[i - 1][0] + evs[i - 1][1]) > 300.0:  # a new burst (step): as device_spans
            start = i
    out, prev_end = [], None
    for ts, dur, name in evs[start : start + limit]:
        gap = 0.0 if prev_end is None else max(0.0, ts - prev_end)
        out.append({"name": name[:120], "us": round(dur, 2), "gap_us": round(gap, 2)})
        prev_end = ts + dur
    return out


def device_timeline(trace: dict, gap_ms: tuple[float, ...] = (0.1, 1.0)) -> dict | None:
    """Over a whole traced run: the union of the device's kernel intervals (busy), the span from the first
    kernel to the last, and the device's idle gaps longer than each of `gap_ms` (count, total ms). A long
    run that is device-bound has busy close to its span; gaps say how much of the rest the host caused."""
    evs = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in _stream_kernels(trace))
    if not evs:
        return None
    busy_us, gaps, (start, end) = 0.0, [], evs[0]
    for ts, te in evs[1:]:
        if ts > end:
            busy_us += end - start
            gaps.append(ts - end)
            start, end = ts, te
        else:
            end = max(end, te)
    busy_us += end - start
    span_us = evs[-1][1] - evs[0][0]
    out = {
        "span_s": span_us / 1e6,
        "busy_s": busy_us / 1e6,
        "busy_share": busy_us / span_us if span_us else 0.0,
    }
    for g in gap_ms:
        big = [x for x in gaps if x > g * 1e3]
        out[f"gaps_over_{g:g}ms"] = {"count": len(big), "total_s": sum(big) / 1e6}
    return out


def load_trace(log_dir: Path) -> dict:
    files = sorted(log_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    with gzip.open(files[-1], "rb") as fp:
        return json.load(fp)


def mixed_inputs(runner, decodes: int, context: int, prefills: int, chunk: int):
    """A step of `decodes` sequences decoding at `context` and `prefills` first chunks of `chunk` tokens."""
    from jaxllm.runner.input_batch import empty_step_inputs

    bs = runner.block_size
    dpages, ppages = -(-context // bs), -(-chunk // bs)
    s = decodes + prefills
    t = decodes + prefills * chunk
    width = max(dpages, ppages)
    if 1 + decodes * dpages + prefills * ppages > runner.num_blocks:
        raise ValueError(f"{decodes}x{context} + {prefills}x{chunk} needs more KV blocks than the cache has")
    inputs = empty_step_inputs(runner.plan.shape_for(t, s, width))
    nxt, row = 1, 0
    for i in range(s):
        dec = i < decodes
        pages, q_len, kv_len = (dpages, 1, context) if dec else (ppages, chunk, chunk)
        table = np.arange(nxt, nxt + pages)
        nxt += pages
        inputs.block_tables[i, :pages] = table
        pos = np.arange(kv_len - q_len, kv_len)
        inputs.input_ids[row : row + q_len] = (pos * 7919 + i) % 1000 + 1
        inputs.positions[row : row + q_len] = pos
        inputs.slot_mapping[row : row + q_len] = table[pos // bs] * bs + pos % bs
        inputs.kv_lens[i] = kv_len
        row += q_len
        inputs.cu_q_lens[i + 1] = row
        inputs.logits_indices[i] = row - 1
    inputs.cu_q_lens[s + 1 :] = row
    inputs.num_seqs[0] = s
    inputs.num_tokens = t
    return inputs


def research_case(runner, inputs):
    """The research variant of `inputs`' bucket compiled ahead, as the server's --enable-research-api
    does for every bucket (runner/compiler.py: compile_research_later), and a ResearchBatch of its
    inputs at the floors, neutral values: the variant runs the same kernels whatever the values, so its
    cost is that of a step serving captures and steers."""
    from jaxllm.runner.research_batch import ResearchBatch, research_dims, smallest_research_inputs

    shape = inputs.shape
    batch = ResearchBatch(smallest_research_inputs(shape[0], runner.hidden_size), False, {})
    packed = batch.packed
    lowered = runner.compiler.lower_research_step(runner.params, runner.kv_caches, shape, packed)
    runner.compiler.ahead_research[(shape, research_dims(packed))] = lowered.compile()
    return batch


def profile_step(
    runner,
    inputs,
    reps: int,
    trace_dir: Path | None,
    host_events: bool = False,
    sequence: int = 0,
    research=None,
) -> dict:
    import jax

    run = lambda: runner._run_model(inputs, all_logits=False, research=research)  # noqa: E731
    jax.block_until_ready(run())  # compile
    jax.block_until_ready(run())
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        walls.append(time.perf_counter() - t0)

    # Back to back, as the engine's overlapped loop runs them: the host's time to enqueue one step (the
    # call returns before the device is done) and the time per step of the whole train. Train ~ dispatch:
    # the host's launches are the bottleneck; train ~ busy: the device is.
    def train(step):
        dispatch, outs, t_train = [], [], time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            outs.append(step())
            dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(outs)
        return (time.perf_counter() - t_train) / reps * 1e3, statistics.median(dispatch) * 1e3

    train_ms, dispatch_ms = train(run)
    # The same with the packed inputs already on the device, one buffer reused by every step: what the
    # host pays to copy them in and for the device addresses that change with each new input buffer.
    resident = dataclasses.replace(inputs, packed=jax.device_put(inputs.packed))
    resident_ms, resident_dispatch_ms = train(
        lambda: runner._run_model(resident, all_logits=False, research=research)
    )
    host_top = None
    if host_events:  # where the host's time to enqueue a step goes, over a traced back-to-back train
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                train(run)
            b2b_trace = load_trace(Path(tmp))
            events = host_event_times(b2b_trace)
            # The device over that train: busy near its span = device-bound; idle gaps = the host's.
            b2b_device = device_timeline(b2b_trace, gap_ms=(0.01, 0.1))
        host_top = [
            {"name": n[:160], "calls_per_step": c / reps, "ms_per_step": us / reps / 1e3}
            for n, (c, us) in sorted(events.items(), key=lambda kv: -kv[1][1])[:40]
        ]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = trace_dir or Path(tmp)
        with jax.profiler.trace(str(log_dir)):
            for _ in range(reps):
                jax.block_until_ready(run())
        trace = load_trace(Path(log_dir))
        kernels, lines, spans = device_kernel_times(trace), device_lines(trace), device_spans(trace)
        seq = kernel_sequence(trace, sequence) if sequence else None
    wall_ms = statistics.median(walls) * 1e3
    row: dict = {
        "wall_ms": wall_ms,
        "min_ms": min(walls) * 1e3,
        "dispatch_ms": dispatch_ms,
        "back_to_back_ms": train_ms,
        "resident_inputs_dispatch_ms": resident_dispatch_ms,
        "resident_inputs_back_to_back_ms": resident_ms,
        "trace_lines": lines,
    }
    if host_top is not None:
        row["host_top_events"] = host_top
        row["back_to_back_device"] = b2b_device
    if seq:
        row["kernel_sequence"] = seq
    if not kernels:
        row["note"] = "no device kernel events in the trace (not a GPU?)"
        return row
    if spans:
        # Per step, when every step is one burst. A step the device idles in for over gap_us (its host
        # enqueues kernels slower than they run: synchronous steps of ~500 small kernels) splits into
        # several bursts; span and gaps are then per burst and bursts_per_step says so.
        row["device_span_ms"] = statistics.median(sp for sp, _ in spans) / 1e3
        row["device_gaps_ms"] = statistics.median(sp - b for sp, b in spans) / 1e3
        row["bursts"] = len(spans)
        row["bursts_per_step"] = len(spans) / reps
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, (_, us) in kernels.items():
        by_kind[kind_of(name)] += us / reps / 1e3
    busy = sum(by_kind.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]
    row.update(
        busy_ms=busy,
        idle_share=max(0.0, 1.0 - busy / wall_ms),
        by_kind_ms=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        top_kernels=[
            {"name": n[:160], "kind": kind_of(n), "calls_per_step": c / reps, "ms_per_step": us / reps / 1e3}
            for n, (c, us) in top
        ],
    )
    return row


def decode_bound(bound_s: float, hardware: str, row: dict) -> dict:
    """A decode step's bound and the shares of it the device's busy time and the back-to-back step reach
    (a share near 1 leaves nothing to gain; the busy share is absent without device events)."""
    out = {
        "bound_ms": bound_s * 1e3,
        "bound_hardware": hardware,
        "back_to_back_share_of_bound": bound_s * 1e3 / row["back_to_back_ms"],
    }
    if row.get("busy_ms"):
        out["busy_share_of_bound"] = bound_s * 1e3 / row["busy_ms"]
    return out


def parse_shape(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--quantization",
        default=None,
        help="a --quantization method (random weights of its layout); the bound is then left out",
    )
    p.add_argument("--decode", action="append", default=[], help="BATCHxCONTEXT, repeatable")
    p.add_argument("--mixed", action="append", default=[], help="DECODESxCONTEXT+PREFILLSxCHUNK, repeatable")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--research",
        action="store_true",
        help="also profile each case's research variant (captures and edits compiled in, as the server's "
        "--enable-research-api serves them; neutral inputs)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the longest case + 16; larger widens every block table as a server's would",
    )
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--trace-dir", default=None, help="keep the raw traces here (one folder per case)")
    p.add_argument(
        "--host-events", action="store_true", help="also trace a back-to-back train: the host's top events"
    )
    p.add_argument(
        "--kernel-sequence",
        type=int,
        default=0,
        metavar="N",
        help="also record a step's first N kernels in order",
    )
    p.add_argument(
        "--hardware", choices=HARDWARE_CHOICES, default="auto", help="peaks for the bound (auto: this GPU's)"
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = [("decode", parse_shape(d), None) for d in args.decode or ["32x640"]]
    for m in args.mixed:
        d, pf = m.split("+")
        cases.append(("mixed", parse_shape(d), parse_shape(pf)))
    max_len = max(max(c[1][1], c[2][1] if c[2] else 0) for c in cases) + 16
    if args.max_model_len is not None:  # the block tables' width: max_model_len / block_size pages
        if args.max_model_len < max_len:
            p.error(f"--max-model-len {args.max_model_len} is below the longest case ({max_len} with a page)")
        max_len = args.max_model_len
    max_seqs = max(c[1][0] + (c[2][0] if c[2] else 0) for c in cases)
    max_tokens = max(c[1][0] + (c[2][0] * c[2][1] if c[2] else 0) for c in cases)

    from jaxllm import LLM

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(max_tokens, 16),
        gpu_memory_utilization=args.gpu_memory_utilization,
        compile_ahead=False,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
    )
    runner = llm.llm_engine.runner
    randomize_kv(runner)
    # roofline.py's shapes count bf16 / f32 weights; a quantized layout's bytes are in startup_info
    shape = shape_for_model(args.model, args.dtype) if args.quantization is None else None
    hw = kernel_hardware(args.hardware)
    rows = []
    runs = [(case, False) for case in cases] + ([(case, True) for case in cases] if args.research else [])
    for (kind, (b, c), pf), with_research in runs:
        inputs = decode_inputs(runner, b, c) if pf is None else mixed_inputs(runner, b, c, *pf)
        label = (
            f"{kind} {b}x{c}" + (f"+{pf[0]}x{pf[1]}" if pf else "") + (" research" if with_research else "")
        )
        tdir = Path(args.trace_dir) / label.replace(" ", "-").replace("+", "_") if args.trace_dir else None
        research = research_case(runner, inputs) if with_research else None
        row = {
            "case": label,
            **profile_step(
                runner, inputs, args.reps, tdir, args.host_events, args.kernel_sequence, research=research
            ),
        }
        if pf is None and shape is not None:
            row.update(decode_bound(decode_step_seconds(shape, [c] * b, hw), hw.name, row))
        rows.append(row)
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in row.get("by_kind_ms", {}).items())
        logger.info(
            "%s: wall %.2f ms, back to back %.2f ms (dispatch %.2f ms; inputs on the device: %.2f, dispatch "
            "%.2f), device burst %.2f ms (gaps %.2f, %.1f bursts per step), busy %.2f ms (%s)",
            label, row["wall_ms"], row["back_to_back_ms"], row["dispatch_ms"],
            row["resident_inputs_back_to_back_ms"], row["resident_inputs_dispatch_ms"], row.get("device_span_ms", 0),
            row.get("device_gaps_ms", 0), row.get("bursts_per_step", 0), row.get("busy_ms", 0), kinds,
        )  # fmt: skip
        if "bound_ms" in row:
            logger.info(
                "  %s bandwidth bound %.2f ms: busy at %s of it, back to back at %.1f%%",
                row["bound_hardware"], row["bound_ms"],
                f"{row['busy_share_of_bound']:.1%}" if "busy_share_of_bound" in row else "n/a",
                100 * row["back_to_back_share_of_bound"],
            )  # fmt: skip
        for k in row.get("kernel_sequence", []):
            logger.info("  kernel %8.2f us (after %6.2f us idle)  %s", k["us"], k["gap_us"], k["name"])
        if row.get("back_to_back_device"):
            logger.info("  back to back, device: %s", json.dumps(row["back_to_back_device"]))
        for ev in row.get("host_top_events", [])[:25]:
            logger.info(
                "  host %8.3f ms/step %7.1f calls  %s", ev["ms_per_step"], ev["calls_per_step"], ev["name"]
            )
    result = make_result(
        "step_profile",
        f"{args.model}-step-profile-{llm.llm_engine.startup_info.get('attention_backend')}",
        args.model,
        vars(args),
        {"steps": rows},
        None,
        startup=llm.llm_engine.startup_info,
    )
    if not args.no_save:
        logger.info("saved %s", save_result(result, args.output_json))
    return result


if __name__ == "__main__":
    main()
