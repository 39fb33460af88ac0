"""Research on the served model, by site name (jaxllm/research_params.py): the logit lens, steering
vectors from contrastive prompt pairs, research arrays as pandas DataFrames (through the engine's
captures), and activations, gradients and attribution patching on the bare functional model
(docs/research.md)."""

from jaxllm.research.frames import captures_frame, top_tokens_frame
from jaxllm.research.functional import Activations, FunctionalModel, functional_model, run_model
from jaxllm.research.gradients import (
    ActivationGradients,
    AttributionPatching,
    activation_gradients,
    attribution_patching,
)
from jaxllm.research.lens import LogitLens, apply_logit_lens, lens_logits, logit_lens, sequence_token_ids
from jaxllm.research.steering_vectors import last_prompt_activations, steering_vector

__all__ = [
    "Activations",
    "ActivationGradients",
    "AttributionPatching",
    "FunctionalModel",
    "LogitLens",
    "activation_gradients",
    "apply_logit_lens",
    "attribution_patching",
    "captures_frame",
    "functional_model",
    "last_prompt_activations",
    "lens_logits",
    "logit_lens",
    "run_model",
    "sequence_token_ids",
    "steering_vector",
    "top_tokens_frame",
]
