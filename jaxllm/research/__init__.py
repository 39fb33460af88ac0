"""Research on the served model: activations, interventions and gradients by site name."""

from jaxllm.research.functional import Activations, FunctionalModel, functional_model, run_model
from jaxllm.research.gradients import (
    ActivationGradients,
    AttributionPatching,
    activation_gradients,
    attribution_patching,
)

__all__ = [
    "Activations",
    "ActivationGradients",
    "AttributionPatching",
    "FunctionalModel",
    "activation_gradients",
    "attribution_patching",
    "functional_model",
    "run_model",
]
