"""Research helpers on the served model: the logit lens, steering vectors from contrastive prompt pairs,
and research arrays as pandas DataFrames (docs/research.md)."""

from jaxllm.research.frames import captures_frame, top_tokens_frame
from jaxllm.research.lens import LogitLens, apply_logit_lens, lens_logits, logit_lens, sequence_token_ids
from jaxllm.research.steering_vectors import last_prompt_activations, steering_vector

__all__ = [
    "LogitLens",
    "apply_logit_lens",
    "captures_frame",
    "last_prompt_activations",
    "lens_logits",
    "logit_lens",
    "sequence_token_ids",
    "steering_vector",
    "top_tokens_frame",
]
