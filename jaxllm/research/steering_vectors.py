"""A steering vector from contrastive prompt pairs (difference of means, as in activation addition).

For pairs (positive_k, negative_k), k = 1..N, and a layer site s ("residual.12", "mlp_out.3", ...):

    v = 1/N * sum_k ( a_s(positive_k)[last prompt position] - a_s(negative_k)[last prompt position] )

where a_s is the activation the engine captures at s. All 2N prompts go through the engine in one batch
(one prompt step each, nothing generated beyond the one token every request samples); the result is
f32[H], ready for `Steer(site, v, scale)`. The last prompt position is the one whose activation decides
the next token, so the pair's difference there is the direction that moves what comes next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllm.research_params import ResearchParams, parse_site
from jaxllm.sampling_params import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids


def last_prompt_activations(llm, prompts: Sequence[Prompt], site: str) -> np.ndarray:  # f32[N, H]
    """The activation at layer site `site` of each prompt's last token, one engine batch."""
    s = parse_site(site, "site")
    if s.layer is None:
        raise ValueError(f"site: {site!r} must be a layer site (residual.i, attn_out.i, mlp_out.i)")
    if not prompts:
        raise ValueError("prompts: empty")
    params = SamplingParams(
        temperature=0.0, max_tokens=1, research=ResearchParams(capture=[site], capture_positions="prompt")
    )
    items = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    outs = llm.generate(items, params, use_tqdm=False)
    rows = []
    for out in outs:
        caps = out.outputs[0].captures
        last = len(out.prompt_token_ids) - 1
        rows.append(np.asarray(caps.arrays[str(s)][caps.positions.index(last)], np.float32))
    return np.stack(rows)


def steering_vector(llm, pairs: Sequence[tuple[Prompt, Prompt]], site: str) -> np.ndarray:  # f32[H]
    """The mean over `pairs` of (activation of the positive prompt - that of the negative one) at `site`,
    each at its prompt's last position."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("pairs: no (positive, negative) prompt pairs given")
    for k, pair in enumerate(pairs):
        if isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"pairs[{k}]: must be a (positive, negative) pair of prompts")
    acts = last_prompt_activations(llm, [p for pair in pairs for p in pair], site)  # f32[2N, H]
    return (acts[0::2] - acts[1::2]).mean(axis=0).astype(np.float32)
