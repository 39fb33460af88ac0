"""jaxllm: high-throughput LLM inference and an OpenAI-compatible server on JAX/XLA.

from jaxllm import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from jaxllm.outputs import Captures, CompletionOutput, RequestOutput
from jaxllm.research_params import Patch, ResearchParams, Scale, Steer
from jaxllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "ResearchParams",
    "Steer",
    "Scale",
    "Patch",
    "RequestOutput",
    "CompletionOutput",
    "Captures",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in jax; keep `import jaxllm` light for the server and the host-only core.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":  # every engine option, as vLLM's EngineArgs (no jax)
        from jaxllm.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
