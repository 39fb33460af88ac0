"""Flax models (functional linen modules) and their architecture config; see llama.py / opt.py for the trees."""

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.registry import abstract_params, build_model, get_model_class, supported_architectures

__all__ = ["ModelArchConfig", "abstract_params", "build_model", "get_model_class", "supported_architectures"]
