"""Grammars for structured outputs: a request's `StructuredOutputsParams` -> a compiled llguidance grammar.

    StructuredOutputsParams --grammar_text--> llguidance grammar text (JSON schema, regex, choice, GBNF/Lark)
      --GrammarCompiler.compile--> CompiledGrammar (validated; cached by grammar text, LRU)
      --CompiledGrammar.new_matcher--> one llguidance matcher per request (runner/request_state.py)

Why llguidance: it has no dependencies (xgrammar needs torch, which a serving install does not have),
builds its lexer and parser lazily so a new JSON schema compiles in about a millisecond, and fills the
next-token bitmask of many rows at once on its own threads without the GIL
(benchmarks/grammar_engines.py compares the engines; docs/performance.md has the figures).

JSON is written with fixed separators (", " and ": "; "," and ":" with `disable_any_whitespace`): a
grammar that lets whitespace run freely lets a small model emit newlines until max_tokens.

`compile` is called off the engine step's thread (AsyncLLMEngine compiles a new grammar on an executor
thread before handing the request over); llguidance drops the GIL while it builds a grammar.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxllm.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not validated yet: `GrammarCompiler.compile` does that)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif isinstance(params.json, str):
            try:
                schema = json.loads(params.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        else:
            schema = params.json
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if params.disable_additional_properties:
            schema = _no_additional_properties(copy.deepcopy(schema))
        compact = params.disable_any_whitespace
        options = {
            "whitespace_flexible": False,
            "item_separator": "," if compact else ", ",
            "key_separator": ":" if compact else ": ",
        }
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {e}") from None
    # "grammar": GBNF or Lark, told apart by llguidance
    fmt, text = {"regex": ("regex", params.regex), "choice": ("choice", json.dumps(params.choice))}.get(
        kind, ("grammar", params.grammar)
    )
    try:
        return llguidance.grammar_from(fmt, text)
    except ValueError as e:
        raise ValueError(f"structured_outputs={kind}: not a valid {kind}: {e}") from None


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A validated grammar bound to the model's tokenizer; each request matches from a copy of `_template`."""

    text: str
    _template: Any  # llguidance.LLMatcher in its start state, never advanced

    def new_matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles and caches grammars for one model's tokenizer. Thread-safe: the server compiles on executor
    threads while the engine thread takes compiled grammars for new requests.

    Two caches: by grammar text (what compiling costs), and by the request's StructuredOutputsParams
    object, which travels unchanged from the server through the engine to the runner. The second keeps
    `grammar_text` (tens to hundreds of microseconds for a JSON schema) off the engine thread, where the
    runner asks for the grammar of every new constrained request.

    `vocab_size` is the model's (the bitmask's width): ids the tokenizer does not have are never allowed."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids or [])
        self._ll_tokenizer = None  # built at the first compile: a second of start-up nobody else needs
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        # id(params) -> (params, its grammar): the params are held, so their id is not reused meanwhile
        self._by_params: OrderedDict[int, tuple[StructuredOutputsParams, CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                kwargs: dict = {"n_vocab": self.vocab_size}
                if self.eos_token_ids:
                    eos = self.eos_token_ids
                    kwargs["eos_token"] = eos[0] if len(eos) == 1 else eos
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, **kwargs)
            return self._ll_tokenizer

    def _seen(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        with self._lock:
            entry = self._by_params.get(id(params))
            return entry[1] if entry is not None and entry[0] is params else None

    def _lookup(self, params: StructuredOutputsParams, text: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self._remember(params, hit)
            return hit

    def _remember(self, params: StructuredOutputsParams, compiled: CompiledGrammar) -> None:
        """Under the lock."""
        self._by_params[id(params)] = (params, compiled)
        self._by_params.move_to_end(id(params))
        while len(self._by_params) > _CACHE_SIZE:
            self._by_params.popitem(last=False)

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if it is in the cache (never compiles)."""
        hit = self._seen(params)
        if hit is not None:
            return hit
        try:
            text = grammar_text(params)
        except ValueError:
            return None
        return self._lookup(params, text)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`, from the caches or built now; ValueError naming
        structured_outputs when the schema, regex or grammar is not valid."""
        import llguidance

        hit = self._seen(params)
        if hit is not None:
            return hit
        text = grammar_text(params)
        hit = self._lookup(params, text)
        if hit is not None:
            return hit
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if failed:
            raise ValueError(
                f"structured_outputs={params.kind}: not a valid {params.kind}: {messages[0].strip()}"
            )
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(
                f"structured_outputs={params.kind}: not a valid {params.kind}: {template.get_error()}"
            )
        compiled = CompiledGrammar(text, template)
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            self._remember(params, compiled)
        return compiled
