"""Research arrays as tidy pandas DataFrames: one row per observation, ready for groupby, pivot and plot.

captures_frame: one row per (site, position) of a request's Captures, with the token at that position and
summary columns of the activation vector (L2 norm, mean, std, largest magnitude). Summaries, not the
vector's H columns, because what one plots across layers and positions is a number per row (the residual
norm growing with depth, an MLP output spiking on one token); a 576-column or object-column frame is
neither tidy nor cheap. The vectors stay in `Captures.arrays` (site -> [P, H]); `vectors=True` adds them
as a `vector` column (one f32[H] array per row) for the rare frame that must carry them.

top_tokens_frame: one row per (layer, position, rank) of a logit lens's top-k tokens. The classic lens
table is a pivot of it: `df[df["rank"] == 0].pivot(index="layer", columns="position", values="token")`.

pandas is not a dependency of jaxllm (serving never needs it): it is imported when these are called.
"""

from __future__ import annotations

import numpy as np

from jaxllm.outputs import Captures, RequestOutput
from jaxllm.research.lens import LogitLens, sequence_token_ids
from jaxllm.research_params import parse_site

CAPTURE_COLUMNS = ["site", "kind", "layer", "position", "token_id", "token", "norm", "mean", "std", "max_abs"]
TOP_TOKEN_COLUMNS = ["layer", "position", "input_token", "rank", "token_id", "token", "prob", "logprob"]


def _pandas():
    try:
        import pandas
    except ImportError as e:  # pragma: no cover - pandas is in the test extra
        raise ImportError("jaxllm.research frames need pandas: pip install pandas") from e
    return pandas


def _decode(tokenizer, ids) -> list[str | None]:
    if tokenizer is None:
        return [None] * len(ids)
    return [None if t is None else tokenizer.decode([int(t)]) for t in ids]


def captures_frame(
    source: RequestOutput | Captures,
    tokenizer=None,
    *,
    sample: int = 0,
    vectors: bool = False,
):
    """A row per captured (site, position): columns CAPTURE_COLUMNS (+ `vector` with `vectors`).

    `source`: a finished RequestOutput (its sample `sample`'s captures; the token columns come from its
    sequence) or bare Captures (token columns empty). `layer` is <NA> for final_norm and logits; `token`
    is filled when a tokenizer (llm.get_tokenizer()) is given. Statistics are in float32."""
    pd = _pandas()
    if isinstance(source, RequestOutput):
        captures = source.outputs[sample].captures
        if captures is None:
            raise ValueError(f"source: sample {sample} of request {source.request_id} captured nothing")
        seq = sequence_token_ids(source, sample)
        token_ids = [seq[p] for p in captures.positions]
    elif isinstance(source, Captures):
        captures, token_ids = source, [None] * len(source.positions)
    else:
        raise TypeError(f"source: a RequestOutput or Captures, got {type(source).__name__}")
    tokens = _decode(tokenizer, token_ids)
    parts = []
    for name, arr in captures.arrays.items():
        a = np.asarray(arr, np.float32)  # f32[P, H] (or [P, V] for logits)
        s = parse_site(name)
        part = {
            "site": name,
            "kind": s.kind,
            "layer": pd.array([s.layer] * len(a), dtype="Int64"),
            "position": captures.positions,
            "token_id": pd.array(token_ids, dtype="Int64"),
            "token": tokens,
            "norm": np.linalg.norm(a, axis=-1),
            "mean": a.mean(axis=-1),
            "std": a.std(axis=-1),
            "max_abs": np.abs(a).max(axis=-1),
        }
        if vectors:
            part["vector"] = list(a)
        parts.append(pd.DataFrame(part))
    columns = CAPTURE_COLUMNS + (["vector"] if vectors else [])
    if not parts:
        return pd.DataFrame(columns=columns)
    return pd.concat(parts, ignore_index=True)[columns]


def top_tokens_frame(lens: LogitLens, tokenizer=None, k: int = 5):
    """A row per (layer, position, rank) of the lens's top-k: columns TOP_TOKEN_COLUMNS. `input_token`
    is the token at `position` (what the layer has read last), `token` the predicted next token; both
    are decoded text when a tokenizer is given, ids otherwise."""
    pd = _pandas()
    ids, logprobs = lens.top_tokens(k)  # i32[Ly, P, k], f32[Ly, P, k]
    ly, p, _ = ids.shape
    layer = np.repeat(np.asarray(lens.layers), p * k)
    position = np.tile(np.repeat(np.asarray(lens.positions), k), ly)
    inputs = lens.token_ids if lens.token_ids is not None else [None] * p
    input_tokens = _decode(tokenizer, inputs) if tokenizer is not None else inputs
    flat_ids = ids.reshape(-1)
    return pd.DataFrame(
        {
            "layer": layer,
            "position": position,
            "input_token": np.tile(np.repeat(np.asarray(input_tokens, dtype=object), k), ly),
            "rank": np.tile(np.arange(k), ly * p),
            "token_id": flat_ids,
            "token": _decode(tokenizer, flat_ids) if tokenizer is not None else flat_ids,
            "prob": np.exp(logprobs.reshape(-1)),
            "logprob": logprobs.reshape(-1),
        }
    )[TOP_TOKEN_COLUMNS]
