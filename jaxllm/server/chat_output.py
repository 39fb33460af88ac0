"""One choice's generated text -> the assistant message's fields and finish reason, whole or streamed.

    text --reasoning parser (--reasoning-parser)--> reasoning_content | content
         content --by the ToolPlan's mode--> none:     content
                                             auto:     the --tool-call-parser: content, tool_calls
                                             required: the JSON array of calls -> tool_calls
                                             named:    the text is the function's arguments
A stream feeds each delta through the same chain (`feed`, then `finish` with the last output) and
sends what comes out: `reasoning_content`, `content` and OpenAI's `tool_calls` deltas. A single response
runs the parsers over the whole text, which gives the same result (tool_parsers/base.py says when not).

Under "required" and a named function the output is decoded under a JSON schema from its first token,
so it has no reasoning part: the reasoning parser is not used there.

finish_reason is "tool_calls" when calls were returned under "auto" or "required" (as vLLM and OpenAI);
a named function keeps the engine's reason ("stop"), as vLLM does. Without parallel_tool_calls, "auto"
returns the first call only (vLLM's behaviour; "required" has maxItems 1 in its schema).
"""

from __future__ import annotations

from jaxllm.server.reasoning import ReasoningParser
from jaxllm.server.tool_choice import ToolPlan
from jaxllm.server.tool_parsers import ToolParser
from jaxllm.server.tool_parsers.forced import NamedToolParser, RequiredToolParser


def needs_reader(plan: ToolPlan, reasoning_parser: type[ReasoningParser] | None) -> bool:
    """Whether the output is more than plain content."""
    return plan.mode != "none" or reasoning_parser is not None


class ChoiceReader:
    def __init__(
        self,
        plan: ToolPlan,
        tool_parser: type[ToolParser] | None,
        reasoning_parser: type[ReasoningParser] | None,
        *,
        stream: bool,
    ) -> None:
        self.mode = plan.mode
        self.has_reasoning = reasoning_parser is not None and plan.mode not in ("required", "named")
        self._reasoning = reasoning_parser() if self.has_reasoning else None
        self._named: NamedToolParser | None = None
        self._tools: ToolParser | None = None
        if plan.mode == "auto":
            self._tools = tool_parser(stream=stream)
        elif plan.mode == "required":
            self._tools = RequiredToolParser(stream=stream)
        elif plan.mode == "named":
            self._named = NamedToolParser(plan.function_name)
        self._max_calls = None if plan.parallel_tool_calls or plan.mode != "auto" else 1

    @property
    def tools_called(self) -> bool:
        if self._named is not None:
            return True
        return self._tools is not None and self._tools.tools_called

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason is not None and self.tools_called and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    # --- a stream -----------------------------------------------------------------------------------
    def feed(self, text: str) -> dict:
        """The delta fields for a piece of output."""
        return self._step(text, final=False)

    def finish(self) -> dict:
        """The delta fields of what was held back, at the end of the output."""
        return self._step("", final=True)

    def last(self, text: str) -> dict:
        """The delta fields of the output's last piece and of everything held back, as one delta."""
        fields = self.feed(text)
        for k, v in self.finish().items():
            fields[k] = (
                _merge_call_deltas(fields.get(k, []), v) if k == "tool_calls" else fields.get(k, "") + v
            )
        return fields

    def _step(self, text: str, final: bool) -> dict:
        out: dict = {}
        if self._reasoning is not None:
            r = self._reasoning.finish() if final else self._reasoning.feed(text)
            if r.reasoning:
                out["reasoning_content"] = r.reasoning
            text = r.content
        if self._named is not None:
            calls = self._named.feed(text) if text else []
            if final:
                calls += self._named.finish()
            if calls:
                out["tool_calls"] = calls
            return out
        if self._tools is None:
            if text:
                out["content"] = text
            return out
        d = self._tools.finish() if final and not text else self._tools.feed(text)
        if final and text:
            e = self._tools.finish()
            d.content += e.content
            d.tool_calls = _merge_call_deltas(d.tool_calls, e.tool_calls)
        if d.content:
            out["content"] = d.content
        calls = [c for c in d.tool_calls if self._max_calls is None or c["index"] < self._max_calls]
        if calls:
            out["tool_calls"] = calls
        return out

    # --- a whole output -----------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """The assistant message for the whole output (a reader made with stream=False)."""
        fields = self.last(text)
        msg: dict = {"role": "assistant"}
        if self.has_reasoning:
            msg["reasoning_content"] = fields.get("reasoning_content") or None
        content = fields.get("content", "")
        if self.tools_called or self.has_reasoning:
            content = content or None
        msg["content"] = content
        if self.tools_called:
            msg["tool_calls"] = [_call_of(d) for d in fields.get("tool_calls", [])]
        return msg


def _merge_call_deltas(first: list[dict], then: list[dict]) -> list[dict]:
    """Tool-call deltas of two consecutive pieces as one list, one entry per call."""
    by_index = {d["index"]: {**d, "function": dict(d["function"])} for d in first}
    for d in then:
        if d["index"] in by_index:
            by_index[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        else:
            by_index[d["index"]] = {**d, "function": dict(d["function"])}
    return [by_index[i] for i in sorted(by_index)]


def _call_of(delta: dict) -> dict:
    """A complete call from its (merged) first delta."""
    return {"id": delta["id"], "type": "function", "function": dict(delta["function"])}
