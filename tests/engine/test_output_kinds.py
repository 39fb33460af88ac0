"""The three output kinds of the output processor, on a byte-level BPE (characters split over tokens):

- CUMULATIVE's text at every step is what a plain reference makes of the tokens so far (decode them,
  cut at the first stop string, hold back an end that could still become one);
- DELTA's outputs are exactly the differences between consecutive CUMULATIVE outputs, per sample (text,
  token ids, logprob positions, the finish reason once), listing a sample only when it has something
  new, and every sample in the first output, which alone carries the prompt logprobs;
- FINAL_ONLY gives one output, at the end, equal to CUMULATIVE's last;
for n > 1 samples that get tokens at different steps, stop strings, stop tokens, logprobs and aborts.
The engine's own step loop (LLMEngine._process) is checked on a tiny model at the end."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from jaxllm.outputs import RequestMetrics
from jaxllm.request import Request, RequestStatus
from jaxllm.runner_output import TokenLogprobs
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.testing.tiny_models import build_tokenizer

KINDS = list(RequestOutputKind)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _lp(token_ids: list[int], top: int = 2) -> TokenLogprobs:
    """Deterministic logprob rows: the chosen token, then `top` fixed ids, ranks 1.. in that order."""
    rows = [[t] + [3 + j for j in range(top)] for t in token_ids]
    lps = [[-0.5 - 0.01 * t - j for j in range(top + 1)] for t in token_ids]
    ranks = [list(range(1, top + 2)) for _ in token_ids]
    return TokenLogprobs(np.asarray(rows, np.int32), np.asarray(lps, np.float32), np.asarray(ranks, np.int32))


def run(tok, seqs, params: SamplingParams, *, abort_at: int | None = None, stop_token: int | None = None):
    """Plays the scheduler and the engine's step loop for one request whose sample i receives seqs[i][k] at
    step k (None: no token that step). A sample ends by length after its last token, at `stop_token`,
    or at a stop string; `abort_at` aborts the request before that step. Returns its outputs."""
    op = OutputProcessor(tok)
    children = []
    for i, seq in enumerate(seqs):
        req = Request(
            f"r#{i}",
            list(PROMPT),
            params,
            max_tokens=sum(t is not None for t in seq),
            status=RequestStatus.RUNNING,
        )
        children.append(ChildState(req, i, IncrementalDetokenizer(tok, PROMPT, params.skip_special_tokens)))
    parent = ParentState("r", None, list(PROMPT), children, RequestMetrics(0.0))
    op.add(parent)
    if params.prompt_logprobs is not None:
        op.on_prompt_logprobs("r#0", _lp(PROMPT[1:]))
    outs = []
    for k in range(max(map(len, seqs))):
        if k == abort_at:
            for c in children:
                if not c.request.is_finished:
                    c.request.status = RequestStatus.FINISHED_ABORTED
            out = op.make_output(parent)
            outs += [out] if out is not None else []
            break
        touched = False
        for c, seq in zip(children, seqs):
            r = c.request
            if r.is_finished or k >= len(seq) or seq[k] is None:
                continue
            touched = True
            r.output_token_ids.append(seq[k])
            if seq[k] == stop_token:
                r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop_token
            elif r.num_output_tokens >= r.max_tokens:
                r.status = RequestStatus.FINISHED_LENGTH
            lp = _lp([seq[k]]) if params.logprobs is not None else None
            stop = op.on_tokens(r, [seq[k]], lp)
            if stop is not None and not r.is_finished:
                r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if touched:
            out = op.make_output(parent)
            outs += [out] if out is not None else []
        if parent.finished:
            break
    return outs


def reference_text(full: str, stops: list[str], include: bool, finished: bool) -> str:
    """What a sample may show of `full`: cut at the earliest stop string; while running, without the
    longest end that is the beginning of a stop string."""
    hits = [(full.find(s), s) for s in stops if s in full]
    if hits:
        i, s = min(hits)
        return full[: i + len(s)] if include else full[:i]
    if finished:
        return full
    hold = max([k for s in stops for k in range(1, len(s)) if full.endswith(s[:k])], default=0)
    return full[: len(full) - hold]


def check_kinds(tok, seqs, params: SamplingParams, **kw):
    """Runs every kind; checks DELTA and FINAL_ONLY against CUMULATIVE; returns CUMULATIVE's outputs."""
    cum, delta, final = (run(tok, seqs, params.clone(output_kind=kind), **kw) for kind in KINDS)
    assert cum and len(delta) == len(cum)
    assert all(len(o.outputs) == len(seqs) for o in cum)
    # FINAL_ONLY: one output, CUMULATIVE's last.
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs == cum[-1].outputs
    assert final[0].prompt_logprobs == cum[-1].prompt_logprobs
    # DELTA: the differences of consecutive CUMULATIVE outputs.
    prev = {i: ("", [], [], None) for i in range(len(seqs))}
    for k, (c_out, d_out) in enumerate(zip(cum, delta, strict=True)):
        assert d_out.finished == c_out.finished
        assert d_out.prompt_logprobs == (c_out.prompt_logprobs if k == 0 else None)
        expected = []
        for o in c_out.outputs:
            text, ids, lps, finish = prev[o.index]
            assert o.text.startswith(text)  # streamed text is never taken back
            new = (
                o.text[len(text) :],
                o.token_ids[len(ids) :],
                (o.logprobs or [])[len(lps) :],
                o.finish_reason if finish is None else None,
            )
            if k == 0 or new[0] or new[1] or new[3]:
                expected.append((o.index, *new, o.stop_reason))
            prev[o.index] = (o.text, o.token_ids, o.logprobs or [], o.finish_reason)
        got = [
            (o.index, o.text, o.token_ids, o.logprobs or [], o.finish_reason, o.stop_reason)
            for o in d_out.outputs
        ]
        assert got == expected, k
    # Each sample's finish reason exactly once.
    finishes = [o.index for d in delta for o in d.outputs if o.finish_reason is not None]
    assert sorted(finishes) == list(range(len(seqs)))
    return cum


def test_text_at_every_step_matches_the_reference(tok):
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    ids = tok.encode(text)
    stops = ["lazy dog!", "brown foxes", "zzz"]
    cum = check_kinds(tok, [ids], SamplingParams(stop=stops))
    held = 0
    for k, out in enumerate(cum):
        full = tok.decode(ids[: k + 1])  # ASCII: every token is whole characters
        (o,) = out.outputs
        assert o.text == reference_text(full, stops, False, out.finished), k
        held += o.text != full
    assert held >= 2  # "brown fox" and "lazy dog" were each held until the next token ruled them out
    assert cum[-1].outputs[0].text == text and cum[-1].outputs[0].finish_reason == "length"
    cut = check_kinds(tok, [ids], SamplingParams(stop=["zzz", "jumps ov"]))
    assert cut[-1].outputs[0].text == "The quick brown fox "
    assert cut[-1].outputs[0].finish_reason == "stop" and cut[-1].outputs[0].stop_reason == "jumps ov"


def test_held_text_is_released_when_the_stop_string_fails(tok):
    text = "Paged attention stores the KV cache in blocks"
    ids = tok.encode(text)
    cum = check_kinds(tok, [ids], SamplingParams(stop=["the KV cache in blocks of sixteen"]))
    assert cum[-1].outputs[0].text == text and cum[-1].outputs[0].finish_reason == "length"
    assert cum[-2].outputs[0].text == "Paged attention stores "  # held until the end: a stop may follow


@pytest.mark.parametrize("include", [False, True])
def test_split_characters_samples_and_logprobs(tok, include):
    texts = ["héllo wörld, naïve café — 世界 你好 🙂 emoji", "0123 世界 🙂 and accents 你好 ok", "naïve 🙂"]
    seqs = [tok.encode(t) for t in texts]
    seqs[1] = [None, None] + seqs[1]  # sample 1 gets its first token two steps late
    seqs[2] = [t for x in seqs[2] for t in (x, None)]  # sample 2 every other step
    assert any("\ufffd" in tok.decode([t]) for t in seqs[0])  # multi-byte characters split over tokens
    params = SamplingParams(
        n=3, stop=["世界 你", "zz"], include_stop_str_in_output=include, logprobs=2, prompt_logprobs=2
    )
    cum = check_kinds(tok, seqs, params)
    last = {o.index: o for o in cum[-1].outputs}
    for i, t in enumerate(texts):
        assert last[i].text == reference_text(t, params.stop_list, include, True), i
        assert len(last[i].logprobs) == len(last[i].token_ids)
    assert last[2].finish_reason == "length" and last[0].stop_reason == "世界 你"
    assert cum[0].prompt_logprobs[0] is None and len(cum[0].prompt_logprobs) == len(PROMPT)


def test_final_only_finds_stop_strings_anywhere_in_a_long_text(tok):
    """FINAL_ONLY keeps only a window of the text that a stop string could still start in."""
    text = "".join(
        [
            "The quick brown fox jumps over the lazy dog. ",
            "Paged attention stores the KV cache in blocks of sixteen tokens. ",
            "Continuous batching keeps the accelerator busy; prefix caching reuses blocks. ",
        ]
        * 2
    )
    ids = tok.encode(text)
    for start in range(40, len(text) - 12, 5):
        stop = text[start : start + 11]
        (out,) = run(
            tok,
            [ids],
            SamplingParams(stop=["no such stop string", stop], output_kind=RequestOutputKind.FINAL_ONLY),
        )
        assert out.outputs[0].text == text[: text.find(stop)], start
        assert out.outputs[0].stop_reason == stop


def test_stop_token_and_abort(tok):
    a, b = tok.encode("The quick brown fox jumps"), tok.encode("héllo wörld, naïve café")
    eos = tok.eos_token_id
    stopped = check_kinds(tok, [a[:3] + [eos], b], SamplingParams(n=2), stop_token=eos)
    first = {o.index: o for o in stopped[-1].outputs}
    assert first[0].finish_reason == "stop" and first[0].stop_reason == eos
    assert first[0].text == tok.decode(a[:3])  # the special end token adds no text
    # Aborted mid-way: the held text (and a split character's bytes) come out with "abort".
    cum = check_kinds(tok, [a, b], SamplingParams(n=2, stop=["jumps!"]), abort_at=5)
    last = {o.index: o for o in cum[-1].outputs}
    assert [last[0].finish_reason, last[1].finish_reason] == ["abort", "abort"]
    assert last[0].text == tok.decode(a[:5]) and last[1].text == tok.decode(b[:5])


def test_output_kind_is_validated_and_cloned():
    p = SamplingParams(output_kind=RequestOutputKind.DELTA)
    assert p.clone(max_tokens=3).output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="output_kind='delta'"):
        SamplingParams(output_kind="delta")


def test_engine_step_emits_each_kind(tiny_llama_dir, jax_cache_dir):
    """LLMEngine.step on a tiny model: the same requests in every kind, side by side in one batch."""
    from jaxllm import LLM

    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=128,
        compilation_cache_dir=jax_cache_dir,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tok) - 3, 9).tolist() for _ in range(2)]
    free = llm.generate(
        None,
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        prompt_token_ids=prompts,
        use_tqdm=False,
    )
    stop = free[0].outputs[0].text[8:11]
    cases = {
        "greedy_stop": SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=1
        ),
        "sampled_n2": SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, prompt_logprobs=1
        ),
    }
    outs: dict[tuple, list] = {}
    for name, p in cases.items():
        for kind in KINDS:
            for j, prompt in enumerate(prompts):
                rid = f"{name}-{kind.name}-{j}"
                engine.add_request(rid, prompt, p.clone(output_kind=kind))
                outs[(name, kind, j)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            name, kind, j = out.request_id.split("-")
            outs[(name, RequestOutputKind[kind], int(j))].append(out)
    for name in cases:
        for j in range(len(prompts)):
            # Different requests sit in different places of the batch: their logprobs agree to rounding.
            cum, delta, final = (outs[(name, kind, j)] for kind in KINDS)
            assert len(final) == 1 and final[0].finished
            _same_positions(final[0].prompt_logprobs, cum[-1].prompt_logprobs)
            _same_positions(delta[0].prompt_logprobs, cum[0].prompt_logprobs)
            assert all(d.prompt_logprobs is None for d in delta[1:])
            for o, f in zip(cum[-1].outputs, final[0].outputs, strict=True):
                assert (f.index, f.text, f.token_ids, f.finish_reason, f.stop_reason) == (
                    o.index,
                    o.text,
                    o.token_ids,
                    o.finish_reason,
                    o.stop_reason,
                )
                _same_positions(f.logprobs, o.logprobs)
                parts = [d for out in delta for d in out.outputs if d.index == o.index]
                assert "".join(d.text for d in parts) == o.text
                assert [t for d in parts for t in d.token_ids] == o.token_ids
                _same_positions([x for d in parts for x in d.logprobs or []] or None, o.logprobs)
                assert [d.finish_reason for d in parts if d.finish_reason] == [o.finish_reason]
    assert outs[("greedy_stop", RequestOutputKind.FINAL_ONLY, 0)][0].outputs[0].finish_reason == "stop"


def _same_positions(a, b, tol=1e-4):
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or [], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert list(x) == list(y)
            assert all(
                abs(x[t].logprob - y[t].logprob) < tol and x[t].decoded_token == y[t].decoded_token for t in x
            )
