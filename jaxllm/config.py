"""The engine's resolved configuration: what it runs with, every value concrete (no jax here).

    EngineArgs (engine_args.py: what users set, None = the platform's default)
      --EngineArgs.create_engine_config(platform, model limits, usage)--> EngineConfig (this module)
      --> loader (ModelSpec), Scheduler (SchedulerConfig, CacheConfig), runner (RunnerConfig), start-up log

Field ranges are checked once, where users set them (EngineArgs). These dataclasses check only the
relations between fields that the scheduler and the mesh rely on, through the same functions EngineArgs
uses, so a bad combination is described the same way wherever it is caught: by the flags' names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
# vLLM's values; "fp8" is "fp8_e4m3" (one byte per element, scaled per layer: jaxllm/kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "orbax")
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-hopper")
QUANTIZATIONS = (None, "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "gguf")
BLOCK_SIZES = (8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
USAGES = ("offline", "server")  # who runs the engine: LLM(...) or the API server (their defaults differ)

# generation_config.json keys the engine takes as request defaults, and the SamplingParams field each sets
# (vLLM's --generation-config takes the same six).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_chunked_prefill_fit(enable_chunked_prefill: bool, max_num_batched_tokens: int, max_model_len: int):
    """Without chunked prefill a whole prompt (up to max_model_len tokens) must fit one step's budget."""
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} (--max-num-batched-tokens) is smaller than "
            f"max_model_len={max_model_len} (--max-model-len) with chunked prefill off "
            "(--no-enable-chunked-prefill): a prompt of max_model_len tokens could never be scheduled; raise "
            "--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill"
        )


def check_process_id(process_id: int, num_processes: int) -> None:
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} (--process-id) must be in [0, num_processes={num_processes}) "
            "(--num-processes)"
        )


def sampling_defaults_from(generation_config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The SamplingParams defaults a generation config (generation_config.json's names) sets; other keys
    (eos ids, do_sample, ...) are not sampling defaults. Raises ValueError naming `where` for a value
    SamplingParams refuses."""
    from jaxllm.sampling_params import SamplingParams

    values = {
        GENERATION_CONFIG_FIELDS[k]: v
        for k, v in generation_config.items()
        if k in GENERATION_CONFIG_FIELDS and v is not None
    }
    try:
        SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    return values


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults for requests that leave fields out, and where they come from (for the log)."""

    values: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    source: str = "none"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model: str | None = None  # HF folder, GGUF file, preset name, Hub id, or None for the embedded model
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None  # orbax cache of converted params
    revision: str | None = None  # of a Hub model id: a branch, tag or commit (None: the default branch)
    tokenizer_revision: str | None = None  # of a Hub tokenizer (None: the model's files)
    download_dir: str | None = None  # the Hub cache for a model id (None: huggingface_hub's)
    name: str | None = None  # the model's name when its folder's is not (a Hub id's snapshot folder)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space_gib: float = 0.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    # Schedule step N+1 while step N runs on the device (its sampled ids feed N+1 on the device); steps with
    # penalties or prompt logprobs, and several hosts, fall back to one step at a time.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        check_chunked_prefill_fit(
            self.enable_chunked_prefill, self.max_num_batched_tokens, self.max_model_len
        )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        check_process_id(self.process_id, self.num_processes)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    attention_backend: str = "reference"  # never "auto" once resolved
    compile_ahead: bool = False  # compile every bucket at start-up (else on first use)
    compile_research: bool = False  # and each bucket's step with research, in the background
    compilation_cache_dir: str | None = None  # JAX's persistent cache; None: off
    executable_cache: bool = False  # keep compiled step executables under the compilation cache
    # Each bucket is this much larger than the one below it. On the host every compiled variant costs
    # seconds of CPU, so fewer, coarser buckets there.
    bucket_growth: int = 2


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's other methods, refused with what to do instead.
REFUSED_SPECULATIVE_METHODS = {
    m: "served are prompt lookup ('ngram') and a draft model ('draft_model', with 'model'); leave "
    "--speculative-config out or use one of those"
    for m in ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
}
SPECULATIVE_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "disable_by_batch_size", "draft_tensor_parallel_size",
)  # fmt: skip
_NGRAM_ONLY_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`): each step proposes up to
    `num_speculative_tokens` tokens per decoding request, which the step verifies in one forward pass
    (jaxllm/spec_decode/).

    method "ngram" (prompt lookup): the tokens that followed the latest earlier occurrence of the request's
    last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output.
    method "draft_model": what `model`, a smaller model of the same vocabulary (a folder, a .gguf file or
    a Hub id, as the main model), decodes greedily from the request's tokens.
    `disable_by_batch_size`: no proposals while this many requests or more run (a full batch gains little
    from them)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (method "draft_model")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's JSON object; raises ValueError naming the key (as `speculative_config.KEY`). As in vLLM,
        a `model` without a `method` means "draft_model"."""
        where = "speculative_config (--speculative-config)"
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(SPECULATIVE_KEYS)}")
        model = d.get("model")
        method = d.get("method", "draft_model" if model is not None else "ngram")
        if method in REFUSED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r}: {REFUSED_SPECULATIVE_METHODS[method]}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r} must be one of {SPECULATIVE_METHODS}")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config.model is required for method 'draft_model': the draft model's "
                    "folder, .gguf file or Hub id"
                )
            for key in _NGRAM_ONLY_KEYS:
                if key in d:
                    raise ValueError(f"speculative_config.{key} applies to method 'ngram', not 'draft_model'")
            tp = d.get("draft_tensor_parallel_size", 1)
            if tp != 1:
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size={tp!r}: the draft model runs on one "
                    "device; give 1 or leave it out"
                )
        else:
            for key in ("model", "draft_tensor_parallel_size"):
                if key in d:
                    raise ValueError(f"speculative_config.{key} applies to method 'draft_model', not 'ngram'")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required (e.g. 4)")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        values = {
            "num_speculative_tokens": d["num_speculative_tokens"],
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
            "disable_by_batch_size": d.get("disable_by_batch_size"),
        }
        for key, v in values.items():
            if v is None and key == "disable_by_batch_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{key}={v!r} must be an integer >= 1")
        if values["num_speculative_tokens"] > 16:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={values['num_speculative_tokens']} must be <= 16"
            )
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={lo} must be <= speculative_config.prompt_lookup_max={hi}"
            )
        return cls(method=method, model=model if method == "draft_model" else None, **values)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    usage: str = "offline"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
