"""EngineArgs: every option of the engine, once: its type, default, help text and vLLM flag (no jax here).

    LLM(model, **kwargs)  -> EngineArgs(model=model, **kwargs)   (an unknown keyword: TypeError naming it)
    jaxllm serve --flags  -> argparse flags generated from the fields (jaxllm/server/args.py)
    EngineArgs --create_engine_config(Platform, model's max length, usage)--> EngineConfig (config.py)

A field left at None takes the platform's default, decided in `create_engine_config` and nowhere else:
max_num_seqs / max_num_batched_tokens follow vLLM's table for the device and the entry point
(engine/batch_defaults.py); max_model_len is the model's, capped on the host; compile_ahead and the
executable cache are on where they pay (accelerators; the server). Values are checked on construction
(ValueError naming the field and its flag), so the command line rejects a bad flag before anything loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from jaxllm.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPES,
    GENERATION_CONFIG_FIELDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    USAGES,
    CacheConfig,
    EngineConfig,
    GenerationDefaults,
    ModelSpec,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_chunked_prefill_fit,
    check_process_id,
    sampling_defaults_from,
)
from jaxllm.engine.batch_defaults import default_batch_limits

# On the host every compiled bucket costs seconds and memory is the CPU's: a model's full context (often
# 32K-128K) would make every request's block table and the largest buckets needlessly large there.
CPU_MAX_MODEL_LEN = 2048
GENERATION_CONFIG_MODES = ("auto", "vllm")
# vLLM's --tokenizer-mode values; jaxllm reads tokenizer files through transformers' fast tokenizer only.
REFUSED_TOKENIZER_MODES = {
    "mistral": "mistral_common's tokenizer is not supported; leave the flag out to read the model's Hugging "
    "Face tokenizer files (tokenizer.json)",
    "deepseek_v32": "DeepSeek-V3.2's own tokenizer is not supported; leave the flag out",
    "custom": "custom tokenizer plugins are not supported; leave the flag out",
}
TOKENIZER_MODES = ("auto", "hf", "slow", *REFUSED_TOKENIZER_MODES)
DISTRIBUTED_EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")


def arg_field(
    default: Any,
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    choices=None,
    ge=None,
    gt=None,
    le=None,
    no_effect: str | None = None,
    json_list: bool = False,
):
    """A field with its command-line metadata: help text, extra flag names (vLLM's short forms), the
    allowed values and bounds (checked in __post_init__, shown by --help). `no_effect`: why a vLLM option
    jaxllm accepts does nothing here (logged once when given: flags_without_effect); `json_list`: a list
    written as one JSON array (`--allowed-origins '["*"]'`), as vLLM takes it."""
    if no_effect is not None:
        help += "; accepted for vLLM's command lines, no effect here"
    return field(
        default=default,
        metadata={
            "help": help,
            "aliases": aliases,
            "choices": choices,
            "ge": ge,
            "gt": gt,
            "le": le,
            "no_effect": no_effect,
            "json_list": json_list,
        },
    )


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Platform:
    """What the platform defaults depend on; the engine's builder fills it from jax."""

    name: str  # jax's backend: "cpu", "gpu", "tpu"
    device_kind: str = ""  # "cpu", "NVIDIA H100 80GB HBM3"
    device_memory_bytes: int | None = None  # the first device's whole memory; None: not known
    num_devices: int = 1  # local devices
    auto_attention_backend: str = "reference"  # what attention_backend="auto" means here
    executable_cache_supported: bool = False  # whether compiled executables survive a reload here


@dataclass(frozen=True, slots=True)
class EngineArgs:
    # ---- the model -------------------------------------------------------------------------------------
    model: str | None = arg_field(
        None,
        "HF folder, GGUF file or random-weight preset (with --load-format dummy); default: the "
        "embedded SmolLM2-135M-Instruct",
    )
    tokenizer: str | None = arg_field(None, "tokenizer folder or Hub id (default: the model's)")
    revision: str | None = arg_field(
        None, "the Hub model's branch, tag or commit (default: its default branch)"
    )
    tokenizer_revision: str | None = arg_field(
        None, "the Hub tokenizer's branch, tag or commit (default: the model's files)"
    )
    download_dir: str | None = arg_field(
        None, "where Hub models are downloaded to and looked up (default: huggingface_hub's cache, $HF_HOME)"
    )
    tokenizer_mode: str = arg_field(
        "auto",
        "which tokenizer implementation: jaxllm reads the tokenizer files through transformers' fast "
        "tokenizer (auto); hf and slow are accepted, mistral, deepseek_v32 and custom refused",
        choices=TOKENIZER_MODES,
        no_effect="jaxllm reads the model's tokenizer files through transformers' fast tokenizer, as auto does",
    )
    trust_remote_code: bool = arg_field(
        False,
        "run a checkpoint's own Python code",
        no_effect="jaxllm runs its own implementation of each architecture, never a checkpoint's code",
    )
    code_revision: str | None = arg_field(
        None, "revision of a checkpoint's own code", no_effect="jaxllm never runs a checkpoint's code"
    )
    dtype: str = arg_field(
        "auto",
        "weights' dtype; auto: the checkpoint's half precision, float32 checkpoints and GGUF become "
        "bfloat16 on an accelerator and stay float32 on the CPU",
        choices=DTYPES,
    )
    quantization: str | None = arg_field(
        None,
        "how the weights are quantized; default: what the checkpoint's quantization_config says (awq, gptq, "
        "compressed-tensors, fp8); fp8 on a float checkpoint quantizes it at load (FP8 weights and "
        "activations); awq_marlin/gptq_marlin are accepted for awq/gptq; gguf: a GGUF file's own types",
        aliases=("-q",),
        choices=QUANTIZATIONS,
    )
    load_format: str = arg_field(
        "auto",
        "auto: by the model's files; dummy: random weights of the model's shape; orbax: only the "
        "converted cache in --checkpoint-dir",
        choices=LOAD_FORMATS,
    )
    checkpoint_dir: str | None = arg_field(
        None, "orbax cache of the converted weights: written on the first load, restored on later ones"
    )
    seed: int = arg_field(0, "seed of the random weights (dummy) and of requests that give no seed")
    max_model_len: int | None = arg_field(
        None,
        f"context length (prompt + output); default: the model's, at most {CPU_MAX_MODEL_LEN} on the CPU",
        ge=1,
    )
    generation_config: str = arg_field(
        "auto",
        "sampling defaults for requests that leave fields out: auto: the model's "
        "generation_config.json (for a GGUF file: its general.sampling.* keys and a generation_config.json "
        "beside it; the embedded model: its card's settings); vllm: SamplingParams' own defaults; a folder: "
        "its generation_config.json",
    )
    override_generation_config: dict[str, Any] | None = arg_field(
        None,
        "JSON object over the generation config, e.g. '{\"temperature\": 0.5}'; keys: "
        + ", ".join(GENERATION_CONFIG_FIELDS),
    )
    max_logprobs: int = arg_field(
        20,
        "the most logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs); at "
        "most 20, the width the sampler computes",
        ge=0,
        le=20,
    )
    # ---- the KV cache ----------------------------------------------------------------------------------
    block_size: int = arg_field(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    gpu_memory_utilization: float = arg_field(
        0.9, "fraction of the accelerator's memory for weights, KV cache and step buffers", gt=0.0, le=1.0
    )
    num_gpu_blocks_override: int | None = arg_field(
        None, "KV cache blocks to allocate, instead of what the memory fraction leaves", ge=1
    )
    swap_space: float = arg_field(
        0.0, "host memory (GiB) that preempted requests' KV blocks are swapped to", ge=0.0
    )
    kv_cache_dtype: str = arg_field(
        "auto",
        "KV cache dtype; auto: the weights'. fp8 (= fp8_e4m3) and fp8_e5m2 store K and V in one byte, "
        "divided by per-layer scales (the checkpoint's k_scale / v_scale, else 1.0): twice the tokens of "
        "bfloat16 in the same memory",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = arg_field(True, "reuse the KV blocks of prompts' common prefixes")
    # ---- the scheduler ---------------------------------------------------------------------------------
    max_num_seqs: int | None = arg_field(
        None, "sequences per step; default: vLLM's for the device and the entry point (64 on the CPU)", ge=1
    )
    max_num_batched_tokens: int | None = arg_field(
        None,
        "tokens per step; default: vLLM's for the device and the entry point (512 on the CPU); "
        "without chunked prefill at least --max-model-len",
        ge=1,
    )
    enable_chunked_prefill: bool = arg_field(True, "split long prompts over several steps")
    scheduling_policy: str = arg_field(
        "fcfs", "fcfs: arrival order; priority: requests' priority, then arrival", choices=SCHEDULING_POLICIES
    )
    async_scheduling: bool = arg_field(True, "schedule the next step while the device runs the current one")
    speculative_config: dict[str, Any] | None = arg_field(
        None,
        "speculative decoding, a JSON object as vLLM takes it: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(prompt lookup: proposals copied from the request's own prompt and output, verified in one "
        "forward pass; greedy and seeded outputs are unchanged), or a draft model of the same tokenizer: "
        '\'{"model": "PATH_OR_HUB_ID", "num_speculative_tokens": 4}\'',
    )
    max_num_queued_reqs: int | None = arg_field(
        None,
        "the server's bound on sequences waiting or running (a request with n > 1 counts n); past it a "
        "request is refused with a 503 and Retry-After (vLLM's flag); default: no bound",
        ge=1,
    )
    # ---- devices and hosts -----------------------------------------------------------------------------
    tensor_parallel_size: int = arg_field(1, "devices the model is split over", aliases=("-tp",), ge=1)
    pipeline_parallel_size: int = arg_field(
        1,
        "pipeline stages; only 1: jaxllm splits a model with --tensor-parallel-size (also over hosts)",
        aliases=("-pp",),
        ge=1,
    )
    data_parallel_size: int = arg_field(
        1,
        "engine replicas in one server; only 1: run one server per replica behind a load balancer",
        aliases=("-dp",),
        ge=1,
    )
    distributed_executor_backend: str | None = arg_field(
        None,
        "vLLM's worker processes (ray, mp, uni, external_launcher)",
        choices=(None, *DISTRIBUTED_EXECUTOR_BACKENDS),
        no_effect="jaxllm runs one process per host, joined by jax.distributed (--coordinator-address)",
    )
    max_parallel_loading_workers: int | None = arg_field(
        None,
        "load the model in sequential batches of this many workers",
        ge=1,
        no_effect="each host loads its own shards, on threads, within one process",
    )
    coordinator_address: str | None = arg_field(
        None, "host:port of process 0 for a mesh over several hosts (also JAXLLM_COORDINATOR_ADDRESS)"
    )
    num_processes: int = arg_field(1, "processes (hosts) in the mesh", ge=1)
    process_id: int = arg_field(0, "this process's rank, 0 .. num_processes-1", ge=0)
    # ---- compilation -----------------------------------------------------------------------------------
    attention_backend: str = arg_field(
        "auto",
        "auto: pallas-hopper on an H100/H200 (sm_90), pallas on other GPUs, reference elsewhere; "
        "pallas-hopper: decode batches and long prefill chunks on the Mosaic GPU kernels, the rest on the "
        "Triton-lowered pallas kernel",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = arg_field(False, "compile no bucket ahead: each compiles on its first use")
    compile_ahead: bool | None = arg_field(
        None,
        "compile every bucket at start-up; default: on accelerators yes, on the CPU no (there each "
        "variant costs seconds, so variants compile on first use and land in the persistent cache)",
    )
    compile_research_ahead: bool = arg_field(
        False,
        "also compile each bucket's model step with research (captures, steering: docs/research.md) at "
        "start-up, in the background; `jaxllm serve --enable-research-api` turns it on",
    )
    compilation_cache_dir: str | None = arg_field(
        None,
        "JAX's persistent compilation cache; default: $JAXLLM_CACHE_DIR or ~/.cache/jaxllm/xla; "
        "'' turns it off",
    )
    executable_cache: bool | None = arg_field(
        None,
        "keep the compiled step executables under the compilation cache and load them at the next "
        "start without tracing (the key holds the engine's source, versions, device and shapes); default: on "
        "for the server on a GPU, off for LLM(...), whose users may patch the forward pass at run time",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_field(f, getattr(self, f.name), _TYPES)
        if self.max_num_batched_tokens is not None and self.max_model_len is not None:
            check_chunked_prefill_fit(
                self.enable_chunked_prefill, self.max_num_batched_tokens, self.max_model_len
            )
        check_process_id(self.process_id, self.num_processes)
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} (--pipeline-parallel-size): jaxllm has no "
                "pipeline parallelism; split the model over devices with --tensor-parallel-size (over several "
                "hosts: --num-processes and --coordinator-address)"
            )
        if self.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} (--data-parallel-size): one jaxllm server runs one "
                "engine; run one server per replica behind a load balancer (deploy/)"
            )
        if self.tokenizer_mode in REFUSED_TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode={self.tokenizer_mode!r} (--tokenizer-mode): "
                f"{REFUSED_TOKENIZER_MODES[self.tokenizer_mode]}"
            )
        if self.enforce_eager and self.compile_ahead:
            raise ValueError(
                "enforce_eager (--enforce-eager) and compile_ahead=True (--compile-ahead) contradict each "
                "other: give one of them"
            )
        if self.generation_config not in GENERATION_CONFIG_MODES and not os.path.isdir(
            self.generation_config
        ):
            raise ValueError(
                f"generation_config={self.generation_config!r} (--generation-config) must be 'auto', 'vllm' or "
                "a folder holding generation_config.json"
            )
        if self.override_generation_config is not None:
            unknown = sorted(set(self.override_generation_config) - set(GENERATION_CONFIG_FIELDS))
            if unknown:
                raise ValueError(
                    f"override_generation_config (--override-generation-config) has unknown keys {unknown}; "
                    f"known: {', '.join(GENERATION_CONFIG_FIELDS)}"
                )
            sampling_defaults_from(
                self.override_generation_config, "override_generation_config (--override-generation-config)"
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)

    # ---- what the engine runs with ---------------------------------------------------------------------
    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            load_format=self.load_format,
            quantization=self.quantization,
            seed=self.seed,
            checkpoint_dir=self.checkpoint_dir,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision,
            download_dir=self.download_dir,
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            coordinator_address=self.coordinator_address,
            num_processes=self.num_processes,
            process_id=self.process_id,
        )

    def create_engine_config(
        self,
        platform: Platform,
        model_max_len: int,
        usage: str,
        generation: GenerationDefaults | None = None,
        model: ModelSpec | None = None,
    ) -> EngineConfig:
        """Every platform default, resolved: the one place where None becomes a value.

        `model_max_len`: the model's max_position_embeddings; `usage`: "offline" (LLM) or "server";
        `generation`: the request sampling defaults read for --generation-config (loader/generation_config.py);
        `model`: the model as resolved (a Hub id's local folder: jaxllm/hub.py; default: model_spec()).
        Raises ValueError naming the flags when the values do not fit together or the model."""
        if usage not in USAGES:
            raise ValueError(f"usage={usage!r} must be one of {USAGES}")
        on_host = platform.name == "cpu"
        if self.max_model_len is None:
            max_model_len = min(model_max_len, CPU_MAX_MODEL_LEN) if on_host else model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} (--max-model-len) exceeds the model's "
                f"max_position_embeddings={model_max_len}"
            )
        else:
            max_model_len = self.max_model_len
        seqs, tokens = default_batch_limits(
            usage, platform.name, platform.device_memory_bytes, platform.device_kind
        )
        if self.max_num_batched_tokens is not None:
            max_tokens = self.max_num_batched_tokens
        elif not self.enable_chunked_prefill:
            max_tokens = max(tokens, max_model_len)  # as vLLM: a whole prompt must fit one step
        else:
            max_tokens = tokens
        compile_ahead = (not on_host if self.compile_ahead is None else self.compile_ahead) and not (
            self.enforce_eager
        )
        keep_executables = usage == "server" if self.executable_cache is None else self.executable_cache
        cache_dir = resolve_compilation_cache_dir(self.compilation_cache_dir)
        return EngineConfig(
            model=model or self.model_spec(),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                swap_space_gib=self.swap_space,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=seqs if self.max_num_seqs is None else self.max_num_seqs,
                max_num_batched_tokens=max_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling,
            ),
            parallel=self.parallel_config(),
            runner=RunnerConfig(
                attention_backend=(
                    platform.auto_attention_backend
                    if self.attention_backend == "auto"
                    else self.attention_backend
                ),
                compile_ahead=compile_ahead,
                compile_research=self.compile_research_ahead and not self.enforce_eager,
                compilation_cache_dir=cache_dir,
                executable_cache=keep_executables and platform.executable_cache_supported and bool(cache_dir),
                bucket_growth=4 if on_host else 2,
            ),
            generation=generation or GenerationDefaults(),
            usage=usage,
            max_logprobs=self.max_logprobs,
            speculative=(
                None
                if self.speculative_config is None
                else SpeculativeConfig.from_dict(self.speculative_config)
            ),
        )

    def non_default(self) -> dict[str, Any]:
        """The fields given a value other than their default (what a start-up log should echo)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


def resolve_compilation_cache_dir(flag: str | None) -> str | None:
    """Where JAX's persistent compilation cache lives: --compilation-cache-dir, else $JAXLLM_CACHE_DIR, else
    ~/.cache/jaxllm/xla; None when the flag is "" (off). `jaxllm doctor` reports the same folder."""
    if flag is None:
        return os.environ.get("JAXLLM_CACHE_DIR") or os.path.expanduser("~/.cache/jaxllm/xla")
    return flag or None


def engine_args_from_kwargs(caller: str, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs from an entry point's keywords; an unknown one is a TypeError naming it (and the
    nearest known name), as Python's own would be for a misspelt argument."""
    unknown = [k for k in kwargs if k not in ENGINE_ARG_NAMES]
    if unknown:
        hints = [
            f"{k!r} (did you mean {m[0]!r}?)"
            if (m := difflib.get_close_matches(k, ENGINE_ARG_NAMES, 1))
            else repr(k)
            for k in unknown
        ]
        raise TypeError(
            f"{caller} got unexpected keyword argument(s) {', '.join(hints)}; its keywords are the fields of "
            "jaxllm.engine_args.EngineArgs"
        )
    return EngineArgs(model=model, **kwargs)


ENGINE_ARG_NAMES = tuple(f.name for f in dataclasses.fields(EngineArgs))


def flags_without_effect(args: Any) -> list[str]:
    """One line per option of `args` (EngineArgs, ServerArgs) given a value other than its default whose
    field says it has no effect here (arg_field's `no_effect`), with the reason."""
    lines = []
    for f in dataclasses.fields(args):
        reason, value = f.metadata.get("no_effect"), getattr(args, f.name)
        if reason is not None and value != f.default:
            given = flag_name(f.name) + ("" if isinstance(value, bool) else f" {value}")
            lines.append(f"{given} has no effect in jaxllm: {reason}")
    return lines


_TYPES = typing.get_type_hints(EngineArgs)


def base_type(annotation: Any) -> Any:
    """`int | None` -> int; `dict[str, Any] | None` -> dict; `str` -> str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return typing.get_origin(annotation) or annotation


def check_field(f: dataclasses.Field, value: Any, hints: dict[str, Any]) -> None:
    """Type, allowed values and bounds from the field's metadata (`hints`: its class's resolved type
    hints); None passes where the field allows it."""
    name = f"{f.name}={value!r} ({flag_name(f.name)})"
    typ = base_type(hints[f.name])
    if value is None:
        if type(None) not in typing.get_args(hints[f.name]):
            raise ValueError(f"{name} must be given")
        return
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, dict),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[typ]
    if not ok:
        raise ValueError(
            f"{name} must be {'an' if typ is int else 'a'} {typ.__name__}"
            + (" of strings" if typ is list else "")
        )
    md = f.metadata
    if md["choices"] is not None and value not in md["choices"]:
        raise ValueError(f"{name} must be one of {[c for c in md['choices'] if c is not None]}")
    if md["ge"] is not None and not value >= md["ge"]:
        raise ValueError(f"{name} must be >= {md['ge']}")
    if md["gt"] is not None and not value > md["gt"]:
        raise ValueError(f"{name} must be > {md['gt']}")
    if md["le"] is not None and not value <= md["le"]:
        raise ValueError(f"{name} must be <= {md['le']}")
