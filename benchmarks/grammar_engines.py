"""Grammar engines measured side by side on the CPU: what choosing one costs a server.

    python -m benchmarks.grammar_engines --out benchmarks/results/<date>-cpu-grammar-engines.json
        [--engines llguidance,xgrammar,outlines_core] [--tokenizers smollm2,synthetic-128k]

    tokenizers: the embedded SmolLM2 (49,152 tokens) and a synthetic byte-level one of Llama-3.1-8B's
        128,256 (benchmarks/byte_level_tokenizer.py)
    per engine and tokenizer:
      setup: the engine's per-tokenizer preparation (once per server start)
      compile: each constraint of grammar_cases.py (11 JSON schemas, a regex, a choice, a GBNF grammar)
        cold  = compile a grammar never seen + make a matcher + fill its first mask (what a request
                with a new schema waits for before its first token), median of --repeats with the engine's
                cache emptied in between; first_cold: the first of them
        cached = what the engine (or a cache a server keeps beside it) gives the second request with the
                same grammar: xgrammar's compiler cache, outlines-core's Index, a copy of a pristine
                llguidance matcher; + a matcher + the first mask
      walk: along each constraint's document (the tokenizer's own encoding), per token: fill the
        next-token bitmask, check that the document's next token is allowed, advance by it; median and
        p99 us per token, pooled over all documents: the first pass after the compile apart (engines
        build some state lazily, as masks need it), then the --walks - 1 passes after it
      batch: 16 rows on the JSON documents in lock step (a row that finishes its document starts it
        again): per step, the engine's batched call for all rows (llguidance's LLExecutor, xgrammar's
        BatchGrammarMatcher) and 16 single fills one after another
    installed: each engine's version, its requirements, the installed size of it and of everything
        it pulls in (from the installed files' RECORDs), and the seconds `import ENGINE` takes

Each engine is imported only when measured, and one that is not installed is reported as such. The
bitmask layout is the one all three share: int32[rows, ceil(vocab / 32)], bit i of word w = token
32 * w + i. A constraint an engine does not support is reported with the engine's message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.grammar_cases import CHOICE_CASE, GRAMMAR_CASE, JSON_CASES, REGEX_CASE, compact

ENGINES = ("llguidance", "xgrammar", "outlines_core")
DISTRIBUTIONS = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines_core": "outlines-core"}
TOKENIZERS = ("smollm2", "synthetic-128k")
LLAMA_VOCAB, LLAMA_BOS, LLAMA_EOS = 128256, 128000, [128001, 128008, 128009]  # jaxllm's llama-3.1-8b preset


class Unsupported(Exception):
    """The engine does not take this kind of constraint, or rejected this one."""


# ---- tokenizers -----------------------------------------------------------------------------------------
class TokenizerCase:
    def __init__(self, name: str, hf, vocab_size: int):
        self.name = name
        self.hf = hf  # a transformers fast tokenizer
        self.vocab_size = vocab_size  # the model's: rows of the mask, >= the tokenizer's length
        self.eos_id = int(hf.eos_token_id)
        self.json = hf.backend_tokenizer.to_str()
        self.special_ids = set(hf.all_special_ids) | {
            i for i, t in hf.added_tokens_decoder.items() if getattr(t, "special", False)
        }

    def token_bytes(self) -> dict[int, bytes]:
        """The bytes each regular token stands for (both tokenizers here are byte-level BPEs)."""
        from benchmarks.byte_level_tokenizer import bytes_to_unicode

        spec = json.loads(self.json)
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise Unsupported(f"{self.name}: token bytes are read only from byte-level tokenizers")
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        return {
            i: bytes(to_byte[c] for c in tok)
            for tok, i in self.hf.get_vocab().items()
            if i not in self.special_ids
        }


def load_tokenizer_case(name: str, workdir: str) -> TokenizerCase:
    if name == "smollm2":
        from jaxllm.tokenizer import load_embedded_tokenizer

        tok = load_embedded_tokenizer()
        return TokenizerCase("smollm2", tok, len(tok))
    if name == "synthetic-128k":
        from transformers import PreTrainedTokenizerFast

        from benchmarks.byte_level_tokenizer import write_byte_level_tokenizer

        path = write_byte_level_tokenizer(os.path.join(workdir, "tok128k"), LLAMA_VOCAB, LLAMA_BOS, LLAMA_EOS)
        return TokenizerCase(name, PreTrainedTokenizerFast.from_pretrained(path), LLAMA_VOCAB)
    raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")


# ---- constraints ------------------------------------------------------------------------------------------
def constraint_cases() -> list[tuple[str, str, Any, str]]:
    """(name, kind, spec, accepted text) for every constraint measured."""
    cases = [(f"json:{c.name}", "json", c.schema, compact(c.document)) for c in JSON_CASES]
    cases.append(("regex", "regex", REGEX_CASE[0], REGEX_CASE[1]))
    cases.append(("choice", "choice", CHOICE_CASE[0], CHOICE_CASE[1]))
    cases.append(("gbnf", "grammar", GRAMMAR_CASE[0], GRAMMAR_CASE[1]))
    return cases


# ---- engines: one adapter each, the same few verbs -----------------------------------------------------
class LLGuidanceEngine:
    """llguidance: a grammar becomes a matcher directly (its lexer is built lazily, as masks need it); no
    compiled object is shared, so the cache a server keeps is a pristine matcher, copied per request."""

    name = "llguidance"
    has_batch = True

    def __init__(self, tok: TokenizerCase, threads: int | None):
        import llguidance
        import llguidance.numpy as llnp

        self.ll, self.llnp = llguidance, llnp
        self.tokenizer = llguidance.LLTokenizer(tok.json, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.cache: dict[str, Any] = {}

    def _grammar(self, kind: str, spec: Any) -> str:
        if kind == "json":
            return self.ll.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": True})
        if kind == "choice":
            return self.ll.grammar_from("choice", json.dumps(spec))
        return self.ll.grammar_from("gbnf" if kind == "grammar" else kind, spec)

    def clear_cache(self) -> None:
        self.cache.clear()

    def compile(self, kind: str, spec: Any, key: str) -> Any:
        if key in self.cache:
            return self.cache[key]
        matcher = self.ll.LLMatcher(self.tokenizer, self._grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise Unsupported(matcher.get_error())
        self.cache[key] = matcher
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m, bitmask: np.ndarray, row: int) -> None:
        self.llnp.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list, bitmask: np.ndarray) -> None:
        self.llnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)

    def reset(self, m) -> None:
        m.reset()


class XGrammarEngine:
    """xgrammar: GrammarCompiler compiles (and caches by grammar) a CompiledGrammar; a GrammarMatcher per
    request walks it."""

    name = "xgrammar"
    has_batch = True

    def __init__(self, tok: TokenizerCase, threads: int | None):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok.hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads or 8, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads or "auto")

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def compile(self, kind: str, spec: Any, key: str) -> Any:
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":  # as an EBNF alternation of string literals, the way vLLM passes it
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
            return self.compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            raise Unsupported(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: np.ndarray, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def reset(self, m) -> None:
        m.reset()


class OutlinesCoreEngine:
    """outlines-core: a JSON schema becomes a regex, the regex and the vocabulary an Index (a token-level
    automaton, built whole ahead); a Guide per request walks it. No context-free grammars."""

    name = "outlines_core"
    has_batch = False

    def __init__(self, tok: TokenizerCase, threads: int | None):
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in tok.token_bytes().items():
            by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_id, by_bytes)
        self.cache: dict[str, Any] = {}

    def clear_cache(self) -> None:
        self.cache.clear()

    def compile(self, kind: str, spec: Any, key: str) -> Any:
        if key in self.cache:
            return self.cache[key]
        if kind == "grammar":
            raise Unsupported("outlines-core has no context-free grammars (regular languages only)")
        try:
            if kind == "json":
                regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
            elif kind == "choice":
                regex = "(" + "|".join(re.escape(c) for c in spec) + ")"
            else:
                regex = spec
            index = self.oc.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError, TypeError) as e:
            raise Unsupported(str(e).splitlines()[0]) from None
        self.cache[key] = index
        return index

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        m.write_mask_into(v.ctypes.data, v.size, 4)

    def fill_batch(self, ms: list, bitmask: np.ndarray) -> None:
        raise NotImplementedError

    def advance(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def reset(self, m) -> None:
        m.reset()


ENGINE_CLASSES = {
    "llguidance": LLGuidanceEngine,
    "xgrammar": XGrammarEngine,
    "outlines_core": OutlinesCoreEngine,
}


# ---- measurements -----------------------------------------------------------------------------------------
def allowed(bitmask_row: np.ndarray, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def allowed_count(bitmask_row: np.ndarray, vocab_size: int) -> int:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return int(bits.sum())


def stats_us(values_s: list[float]) -> dict[str, float | int]:
    if not values_s:
        return {"n": 0}
    a = np.asarray(values_s) * 1e6
    return {
        "n": int(a.size),
        "median_us": round(float(np.median(a)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "mean_us": round(float(a.mean()), 2),
        "max_us": round(float(a.max()), 2),
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure_compile(engine, tok: TokenizerCase, case, repeats: int) -> tuple[dict[str, Any], Any]:
    """Cold and cached time to the first mask of one constraint; returns (figures, compiled)."""
    name, kind, spec, _ = case
    bitmask = np.zeros((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    colds, compiles, first_masks = [], [], []
    compiled = None
    for r in range(repeats):
        engine.clear_cache()
        t0 = time.perf_counter()
        compiled = engine.compile(kind, spec, name)
        t1 = time.perf_counter()
        engine.fill(engine.matcher(compiled), bitmask, 0)
        t2 = time.perf_counter()
        colds.append(t2 - t0)
        compiles.append(t1 - t0)
        first_masks.append(t2 - t1)
        if r == 0 and t2 - t0 > 5.0:  # a slow engine: one cold compile says enough
            break
    cached = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        engine.fill(engine.matcher(engine.compile(kind, spec, name)), bitmask, 0)
        cached.append(time.perf_counter() - t0)
    ms = lambda xs: round(float(np.median(xs)) * 1e3, 3)  # noqa: E731
    return {
        "cold_ms": ms(colds),
        "first_cold_ms": round(colds[0] * 1e3, 3),
        "compile_ms": ms(compiles),
        "first_mask_ms": ms(first_masks),
        "cached_ms": ms(cached),
        "repeats": len(colds),
        "allowed_at_start": allowed_count(bitmask[0], tok.vocab_size),
    }, compiled


def walk(engine, tok: TokenizerCase, compiled, text: str, walks: int) -> dict[str, Any]:
    """Per-token fill and advance along `text`; counts tokens the mask wrongly refused."""
    tokens = tok.hf.encode(text, add_special_tokens=False)
    bitmask = np.zeros((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    fills: list[list[float]] = []  # per pass
    advances: list[float] = []
    refused, rejected, allowed_sum = 0, 0, 0
    eos_allowed_at_end = None
    for w in range(walks):
        m = engine.matcher(compiled)
        fills.append([])
        for t in tokens:
            t0 = time.perf_counter()
            engine.fill(m, bitmask, 0)
            t1 = time.perf_counter()
            ok_mask = allowed(bitmask[0], t)
            t2 = time.perf_counter()
            ok = engine.advance(m, t)
            t3 = time.perf_counter()
            fills[-1].append(t1 - t0)
            advances.append(t3 - t2)
            if w == 0:
                refused += not ok_mask
                rejected += not ok
                allowed_sum += allowed_count(bitmask[0], tok.vocab_size)
            if not ok:
                break
        engine.fill(m, bitmask, 0)
        if w == 0:
            eos_allowed_at_end = allowed(bitmask[0], tok.eos_id)
    return {
        "tokens": len(tokens),
        "fills": fills,
        "advances": advances,
        "mask_refused_document_token": refused,
        "advance_rejected_document_token": rejected,
        "eos_allowed_at_end": eos_allowed_at_end,
        "mean_allowed_tokens": round(allowed_sum / max(len(tokens), 1), 1),
    }


def measure_batch(engine, tok: TokenizerCase, compiled: list[tuple[Any, list[int]]], rows: int, steps: int):
    """`rows` matchers on the JSON documents in lock step: per step the batched fill (if the engine has
    one) and `rows` single fills one after another, then each row advances by its next token.

    The batched and the single fills each have their own matchers, advanced alike: an engine may keep
    the mask of a state it has computed, and a second fill of the same state would only read it back."""
    width = (tok.vocab_size + 31) // 32
    batched_mask = np.zeros((rows, width), dtype=np.int32)
    single_mask = np.zeros((rows, width), dtype=np.int32)
    assignment = [compiled[r % len(compiled)] for r in range(rows)]
    sets = {"single": [engine.matcher(c) for c, _ in assignment]}
    if engine.has_batch:
        sets["batched"] = [engine.matcher(c) for c, _ in assignment]
    position = [0] * rows
    batched, sequential, advance = [], [], []
    mismatched_rows = 0
    for _ in range(steps):
        if engine.has_batch:
            _, s = timed(lambda: engine.fill_batch(sets["batched"], batched_mask))
            batched.append(s)
        t0 = time.perf_counter()
        for r, m in enumerate(sets["single"]):
            engine.fill(m, single_mask, r)
        sequential.append(time.perf_counter() - t0)
        if engine.has_batch:
            mismatched_rows += int((batched_mask != single_mask).any(axis=1).sum())
        for name, matchers in sets.items():
            t0 = time.perf_counter()
            for r, m in enumerate(matchers):
                engine.advance(m, assignment[r][1][position[r]])
            if name == "single":
                advance.append(time.perf_counter() - t0)
        for r in range(rows):  # a finished document starts again (not timed)
            position[r] += 1
            if position[r] == len(assignment[r][1]):
                for matchers in sets.values():
                    engine.reset(matchers[r])
                position[r] = 0
    return {
        "rows": rows,
        "steps": steps,
        "batched_fill_per_step": stats_us(batched) if batched else None,
        "sequential_fill_per_step": stats_us(sequential),
        "advance_all_rows_per_step": stats_us(advance),
        "batched_rows_differing_from_single_fills": mismatched_rows if batched else None,
    }


def measure_engine(name: str, tok: TokenizerCase, args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec(name) is None:
        return {"status": "not installed"}
    engine, setup_s = timed(lambda: ENGINE_CLASSES[name](tok, args.threads))
    out: dict[str, Any] = {"status": "ok", "setup_ms": round(setup_s * 1e3, 1), "constraints": {}}
    first_fills, fills, advances, json_compiled = [], [], [], []
    for case in constraint_cases():
        cname, kind, _, text = case
        try:
            figures, compiled = measure_compile(engine, tok, case, args.repeats)
        except Unsupported as e:
            out["constraints"][cname] = {"unsupported": str(e)[:300]}
            print(f"  {name:14s} {cname:22s} unsupported: {str(e)[:100]}", flush=True)
            continue
        w = walk(engine, tok, compiled, text, args.walks)
        passes = w.pop("fills")
        first_fills += passes[0]
        fills += [x for p in passes[1:] for x in p]
        advances += w.pop("advances")
        figures.update(w)
        out["constraints"][cname] = figures
        if kind == "json":
            json_compiled.append((compiled, tok.hf.encode(text, add_special_tokens=False)))
        print(
            f"  {name:14s} {cname:22s} cold {figures['cold_ms']:9.2f} ms  cached {figures['cached_ms']:8.3f} ms"
            f"  ({figures['tokens']} tokens, refused {figures['mask_refused_document_token']})",
            flush=True,
        )
    out["fill_per_token"] = stats_us(fills)  # the second and later passes
    out["fill_per_token_first_walk"] = stats_us(first_fills)  # the first: lazily built state included
    out["advance_per_token"] = stats_us(advances)
    supported = [c for c in out["constraints"].values() if "cold_ms" in c]
    json_cases = [c for k, c in out["constraints"].items() if k.startswith("json:") and "cold_ms" in c]
    for key, group in (("all", supported), ("json", json_cases)):
        if group:
            out[f"cold_ms_median_{key}"] = round(float(np.median([c["cold_ms"] for c in group])), 3)
            out[f"cold_ms_max_{key}"] = round(max(c["cold_ms"] for c in group), 3)
            out[f"cached_ms_median_{key}"] = round(float(np.median([c["cached_ms"] for c in group])), 4)
    out["unsupported"] = sorted(k for k, c in out["constraints"].items() if "unsupported" in c)
    if json_compiled:
        steps = args.batch_steps or max(len(t) for _, t in json_compiled)
        out["batch"] = measure_batch(engine, tok, json_compiled, args.batch, steps)
    return out


# ---- what each engine needs installed ----------------------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist) -> list[str]:
    """Names of a distribution's unconditional requirements and those whose marker holds here."""
    names = []
    for req in dist.requires or []:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
        marker = req.partition(";")[2]
        if "extra" in marker:
            continue
        if marker and not _marker_holds(marker):
            continue
        names.append(name)
    return names


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker

        return Marker(marker).evaluate()
    except Exception:  # no packaging: count the requirement (errs on the side of a larger closure)
        return True


def _installed_bytes(dist) -> int:
    return sum(f.size or 0 for f in dist.files or [] if getattr(f, "size", None))


def installed_footprint(dist_name: str) -> dict[str, Any]:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    closure, todo = {}, [dist_name]
    while todo:
        n = _norm(todo.pop())
        if n in closure:
            continue
        try:
            d = importlib.metadata.distribution(n)
        except importlib.metadata.PackageNotFoundError:
            closure[n] = None
            continue
        closure[n] = d
        todo += _requirements(d)
    deps = {n: d for n, d in closure.items() if n != _norm(dist_name)}
    return {
        "installed": True,
        "version": dist.version,
        "requires": [r for r in dist.requires or [] if "extra" not in r.partition(";")[2]],
        "installed_mb": round(_installed_bytes(dist) / 2**20, 1),
        "dependency_closure": sorted(deps),
        "missing_dependencies": sorted(n for n, d in deps.items() if d is None),
        "closure_installed_mb": round(
            sum(_installed_bytes(d) for d in closure.values() if d is not None) / 2**20, 1
        ),
        "import_s": import_seconds(dist_name.replace("-", "_")),
    }


def import_seconds(module: str) -> float | None:
    """Seconds `import module` adds to a fresh interpreter's start (median of 3)."""
    runs = []
    for stmt in ("pass", f"import {module}"):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", stmt], capture_output=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                return None
        runs.append(float(np.median(times)))
    return round(runs[1] - runs[0], 3)


def wheel_sizes(directory: str | None) -> dict[str, float]:
    if not directory:
        return {}
    return {
        f: round(os.path.getsize(os.path.join(directory, f)) / 2**20, 2)
        for f in sorted(os.listdir(directory))
        if f.endswith(".whl")
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ---- report --------------------------------------------------------------------------------------------------
def summary_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| tokenizer | engine | setup ms | new grammar ms, JSON (median / max) | cached ms | fill us/token "
        "(median / p99) | first walk us/token (median / p99) | 16 rows us/step: batched / one by one | "
        "unsupported |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for tok_name, engines in results.items():
        for name, r in engines.items():
            if r.get("status") != "ok":
                lines.append(f"| {tok_name} | {name} | {r.get('status')} | | | | | | |")
                continue
            f, f1, b = r["fill_per_token"], r["fill_per_token_first_walk"], r.get("batch") or {}
            batched = (b.get("batched_fill_per_step") or {}).get("median_us", "n/a")
            seq = (b.get("sequential_fill_per_step") or {}).get("median_us", "n/a")
            lines.append(
                f"| {tok_name} | {name} | {r['setup_ms']:.0f} | {r.get('cold_ms_median_json', 'n/a')} / "
                f"{r.get('cold_ms_max_json', 'n/a')} | {r.get('cached_ms_median_all', 'n/a')} | "
                f"{f.get('median_us')} / {f.get('p99_us')} | {f1.get('median_us')} / {f1.get('p99_us')} | "
                f"{batched} / {seq} | {', '.join(r['unsupported']) or '-'} |"
            )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Compile time and mask-fill time of grammar engines (CPU).")
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--tokenizers", default=",".join(TOKENIZERS))
    p.add_argument("--repeats", type=int, default=3, help="cold compiles per constraint (cache emptied)")
    p.add_argument("--walks", type=int, default=3, help="passes along each document")
    p.add_argument("--batch", type=int, default=16, help="rows filled together")
    p.add_argument("--batch-steps", type=int, default=0, help="lock steps (0: the longest JSON document)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    p.add_argument("--wheel-dir", default=None, help="a folder of the engines' wheels, to report their sizes")
    p.add_argument("--no-footprint", action="store_true", help="skip the installed sizes and import times")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.workload import make_result, save_result

    args = make_parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    tokenizers = [t.strip() for t in args.tokenizers.split(",") if t.strip()]
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"--engines: unknown engine {e!r}; known: {', '.join(ENGINES)}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for tok_name in tokenizers:
            tok = load_tokenizer_case(tok_name, workdir)
            print(f"== {tok_name}: {len(tok.hf)} tokens, mask of {tok.vocab_size}", flush=True)
            results[tok_name] = {e: measure_engine(e, tok, args) for e in engines}
    footprint = {} if args.no_footprint else {e: installed_footprint(DISTRIBUTIONS[e]) for e in engines}
    table = summary_table(results)
    print(table)
    result = make_result(
        "grammar_engines",
        "cpu-grammar-engines",
        None,
        vars(args),
        {
            "by_tokenizer": results,
            "installed": footprint,
            "wheels_mb": wheel_sizes(args.wheel_dir),
            "table": table,
        },
        None,
        cpu={"name": cpu_name(), "count": os.cpu_count(), "python": sys.version.split()[0]},
    )
    result["path"] = str(save_result(result, args.out))
    print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    main()
