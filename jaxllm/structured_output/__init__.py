"""Structured outputs and token rules: grammars (llguidance) and the per-row token masks the sampler applies."""

from jaxllm.structured_output.grammar import CompiledGrammar, GrammarCompiler, grammar_text
from jaxllm.structured_output.token_constraint import (
    TokenConstraint,
    bias_arrays,
    bitmask_width,
    fill_token_bitmask,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "TokenConstraint",
    "bias_arrays",
    "bitmask_width",
    "fill_token_bitmask",
    "grammar_text",
]
