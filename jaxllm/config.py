"""Engine configuration: frozen dataclasses checked in `__post_init__` (no jax here).

`EngineConfig` groups what the engine, scheduler and runner need. The CLI and `LLM(...)` build it from
vLLM-named arguments; model-derived values (max_model_len default, KV geometry) are filled in by the
engine once the model's config is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "orbax")
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-hopper")
QUANTIZATIONS = (None, "gguf")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model: str | None = None  # HF folder, GGUF file, preset name, or None for the embedded model
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    checkpoint_dir: str | None = None  # orbax cache of converted params

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype={self.dtype!r} must be one of {DTYPES}")
        _check(
            self.load_format in LOAD_FORMATS,
            f"load_format={self.load_format!r} must be one of {LOAD_FORMATS}",
        )
        _check(
            self.quantization in QUANTIZATIONS,
            f"quantization={self.quantization!r} is not supported; supported: {QUANTIZATIONS}",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len={self.max_model_len} must be >= 1",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space_gib: float = 0.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size={self.block_size} must be one of 8, 16, 32, 64, 128",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]",
        )
        _check(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 1",
        )
        _check(self.swap_space_gib >= 0, f"swap_space={self.swap_space_gib} must be >= 0 (GiB)")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048  # filled from the model when not given
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    # Schedule step N+1 while step N runs on the device (its sampled ids feed N+1 on the device); steps with
    # penalties or prompt logprobs, and several hosts, fall back to one step at a time.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs} must be >= 1")
        _check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1",
        )
        _check(self.max_model_len >= 1, f"max_model_len={self.max_model_len} must be >= 1")
        _check(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            f"with chunked prefill off, max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
            f"max_model_len={self.max_model_len}",
        )
        _check(self.policy in ("fcfs", "priority"), f"policy={self.policy!r} must be 'fcfs' or 'priority'")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        _check(
            self.tensor_parallel_size >= 1, f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1"
        )
        _check(self.num_processes >= 1, f"num_processes={self.num_processes} must be >= 1")
        _check(
            0 <= self.process_id < self.num_processes,
            f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})",
        )


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    # auto: pallas-hopper on sm_90 (Mosaic GPU decode and long-prefill kernels), pallas on other GPUs,
    # reference elsewhere (jaxllm/layers/attention.py: resolve_backend)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # skip ahead-of-time compilation of every bucket at startup
    # Compile every bucket at startup. None: on accelerators yes; on the host no (each variant of a
    # 30-layer model costs seconds of CPU there), so variants compile on first use and land in the
    # persistent cache.
    compile_ahead: bool | None = None
    compilation_cache_dir: str | None = None  # None: ~/.cache/jaxllm/xla ; "" disables
    # Keep compiled step executables under the compilation cache and load them at the next start without
    # tracing (runner/executable_cache.py). None: on for the API server, off for LLM(...) (whose users may
    # patch the forward pass at run time, which the cache's key does not see).
    executable_cache: bool | None = None

    def __post_init__(self) -> None:
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}",
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
