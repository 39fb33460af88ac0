"""LLMEngine start-up: EngineArgs -> a ready engine, each step using what the one before produced.

    size XLA's memory pool, join the other hosts      (before jax starts its backend)
    detect the platform                               -> Platform (device kind and memory, "auto" backend)
    fetch a Hub model id's files, or find them cached -> ModelSpec of a local folder (jaxllm/hub.py)
    open the model: configs or the GGUF header        -> ModelSource (architecture, max length)
    read the generation config                        -> request sampling defaults
    resolve the configuration, once                   -> EngineConfig (EngineArgs.create_engine_config)
    load the weights -> build the runner -> size and allocate the KV cache -> build the scheduler -> compile
    log what the engine runs with (device, settings, limits, sampling defaults), freeze the start-up heap

Everything the log prints is read from the resolved config and the built parts, so the log cannot
disagree with what runs.
"""

from __future__ import annotations

import logging
import os
import time

import jax

from jaxllm.config import EngineConfig, ModelSpec
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.batch_defaults import device_total_memory
from jaxllm.engine.heap import collect_dropped_engines, freeze_startup_heap
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine_args import EngineArgs, Platform, flags_without_effect
from jaxllm.hub import ModelNotFoundError
from jaxllm.kernels.kv_quant import is_fp8
from jaxllm.layers.attention import check_kv_cache_dtype, resolve_backend
from jaxllm.loader import LoadedModel, load_weights, open_model, resolve_model
from jaxllm.loader.generation_config import read_generation_defaults
from jaxllm.parallel import TensorParallelPlan, agree_on_min, initialize_distributed, plan_tensor_parallel
from jaxllm.runner import compilation_cache, executable_cache
from jaxllm.runner.executable_cache import ExecutableCache
from jaxllm.runner.kv_cache import kv_page_dtype
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.spec_decode.draft_model import DraftModelProposer, draft_num_blocks
from jaxllm.spec_decode.speculator import max_speculating_requests, max_verification_tokens
from jaxllm.structured_output.grammar import GrammarCompiler

logger = logging.getLogger("jaxllm")


def size_device_memory_pool(gpu_memory_utilization: float) -> None:
    """XLA's GPU memory pool takes the fraction vLLM users set (JAX's own default is 75%). Effective only
    before JAX starts its backend, so start-up does this first."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{min(gpu_memory_utilization, 0.99):.3f}")


def enable_compilation_cache(path: str | None) -> str | None:
    """JAX's persistent compilation cache in `path` (None: off), so a restart loads what it compiled; its
    entries are checked on read and written whole (runner/compilation_cache.py). Programs that compiled
    faster than JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (JAX's own variable; 0.2 s unless set) are not
    worth a file."""
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    min_compile_s = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    compilation_cache.install(path)
    return path


def log_flags_without_effect(args: EngineArgs) -> None:
    """One line for each vLLM option given that jaxllm accepts but has no use for (its reason)."""
    for line in flags_without_effect(args):
        logger.info(line)


def detect_platform() -> Platform:
    device = jax.local_devices()[0]
    return Platform(
        name=jax.default_backend(),
        device_kind=getattr(device, "device_kind", "") or jax.default_backend(),
        device_memory_bytes=device_total_memory(device.memory_stats()),
        num_devices=jax.local_device_count(),
        auto_attention_backend=resolve_backend("auto"),
        executable_cache_supported=executable_cache.supported(),
    )


def build_engine(args: EngineArgs, usage: str = "offline") -> LLMEngine:
    """`usage`: "offline" for LLM(...), "server" for the API server (their platform defaults differ)."""
    t_start = time.perf_counter()
    collect_dropped_engines()  # an engine dropped since the last start-up frees its device memory now
    size_device_memory_pool(args.gpu_memory_utilization)
    distributed = initialize_distributed(args.parallel_config())  # before any other jax use
    platform = detect_platform()
    logger.info("device: %s", device_description(platform))
    log_flags_without_effect(args)
    spec = resolve_model(args.model_spec())  # a Hub id: its files, fetched or from the cache
    source = open_model(spec, args.tensor_parallel_size)
    generation = read_generation_defaults(args.generation_config, args.override_generation_config, source)
    config = args.create_engine_config(
        platform, source.arch.max_position_embeddings, usage, generation, model=spec
    )
    cache_dir = enable_compilation_cache(config.runner.compilation_cache_dir)
    tp = plan_tensor_parallel(config.parallel.tensor_parallel_size, source.arch)
    loaded = load_weights(source, config.runner.attention_backend, tp.sharding_fn)

    runner = _build_runner(config, loaded, tp, cache_dir)
    # A draft model's weights and cache are in place before the target's cache is sized from what is left.
    draft = _build_draft(config, loaded, cache_dir) if _uses_draft_model(config) else None
    with tp.context():
        num_blocks, why = runner.determine_num_blocks(
            config.cache.gpu_memory_utilization,
            config.cache.num_gpu_blocks_override,
            config.scheduler.max_num_seqs,
        )
    num_blocks = agree_on_min(num_blocks)  # every host allocates the same cache
    num_cpu_blocks = int(config.cache.swap_space_gib * 2**30) // runner.geometry.bytes_per_block
    runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
    scheduler = Scheduler(config.scheduler, config.cache, num_blocks, num_cpu_blocks)
    compile_time_s = 0.0
    if config.runner.compile_ahead:
        with tp.context():
            compile_time_s = runner.compile_all()
        if draft is not None:
            compile_time_s += draft.runner.compile_all()
        spec = config.speculative
        if spec is not None:  # the steps that verify proposals (jaxllm/spec_decode/speculator.py)
            sched_cfg = config.scheduler
            most = max_verification_tokens(spec, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens)
            with tp.context():
                compile_time_s += runner.compile_verification_ahead(most)
    if config.runner.compile_research:
        with tp.context():
            runner.compile_research_later()

    sched = config.scheduler
    info = {
        "model": loaded.model_name,
        "device": platform.device_kind,
        "platform": platform.name,
        "dtype": str(loaded.dtype),
        "quantization": quantization_description(loaded.arch),
        "weight_gib": round(loaded.weight_bytes / 2**30, 3),
        "weight_bytes": loaded.weight_bytes,
        "kv_cache_dtype": str(runner.geometry.dtype),
        **({"kv_cache_scales": kv_scales_source(loaded.params)} if is_fp8(runner.geometry.dtype) else {}),
        "attention_backend": config.runner.attention_backend,
        "num_gpu_blocks": num_blocks,  # vLLM's name (as --num-gpu-blocks-override); on any device
        "num_cpu_blocks": num_cpu_blocks,
        "block_size": config.cache.block_size,
        "kv_cache_gib": round(num_blocks * runner.geometry.bytes_per_block / 2**30, 3),
        "max_model_len": sched.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_concurrency": round(num_blocks * config.cache.block_size / sched.max_model_len, 2),
        "load_time_s": round(loaded.load_time_s, 2),
        "compile_time_s": round(compile_time_s, 2),
        "compiled_variants": runner.num_compiled(),
        "startup_time_s": round(time.perf_counter() - t_start, 2),
        "compilation_cache": cache_dir,
        "executables_loaded": runner.executables.hits,
    }
    if draft is not None:
        info["draft_model"] = config.speculative.model
        info["draft_kv_blocks"] = draft.pool.num_blocks
    for line in startup_lines(config, platform, info, why):
        logger.info(line)
    logger.info(
        "compiled %d step variants in %.1f s, %d more compiling in the background (cache: %s%s)",
        runner.num_compiled(),
        compile_time_s,
        runner.num_compiling_in_background(),
        cache_dir,
        f"; executables: {runner.executables.hits} loaded, {runner.executables.misses} compiled"
        if runner.executables.directory
        else "",
    )
    engine = LLMEngine(
        config,
        loaded,
        runner,
        scheduler,
        tp=tp,
        distributed=distributed,
        cache_dir=cache_dir,
        startup_info=info,
        draft=draft,
    )
    t0 = time.perf_counter()
    info["gc_frozen_objects"] = freeze_startup_heap()
    logger.info(
        "froze the start-up heap for the garbage collector: %d objects in %.2f s",
        info["gc_frozen_objects"],
        time.perf_counter() - t0,
    )
    return engine


def _build_runner(
    config: EngineConfig, loaded: LoadedModel, tp: TensorParallelPlan, cache_dir: str | None
) -> ModelRunner:
    arch, cache = loaded.arch, config.cache
    kv_dtype = kv_page_dtype(cache.kv_cache_dtype, loaded.dtype)
    check_kv_cache_dtype(cache.kv_cache_dtype, kv_dtype, config.runner.attention_backend, jax.devices()[0])
    executables = ExecutableCache(
        os.path.join(cache_dir, "executables") if config.runner.executable_cache and cache_dir else None
    )
    return ModelRunner(
        loaded.module,
        loaded.params,
        num_layers=arch.num_layers,
        num_kv_heads=tp.kv_heads(arch.num_kv_heads),
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        kv_dtype=kv_dtype,
        block_size=cache.block_size,
        max_model_len=config.scheduler.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        bucket_pages=config.runner.attention_backend == "reference",
        bucket_growth=config.runner.bucket_growth,
        single_token_bucket=runs_w4a16_gemv(loaded.params, config.runner.attention_backend, tp.mesh),
        kv_sharding=tp.kv_sharding,
        executable_cache=executables,
        grammar_compiler=grammar_compiler(loaded),
        mesh=tp.mesh,
    )


def runs_w4a16_gemv(params, attention_backend: str, mesh) -> bool:
    """Whether a step of one token runs 4-bit projections on the matrix-vector kernel (int4 codes, a GPU
    backend, no mesh: jaxllm/layers/linear.py), so one decoding sequence gets a bucket of its own."""
    if attention_backend == "reference" or mesh is not None:
        return False
    return any(
        getattr(path[-1], "key", None) == "qweight" and leaf.dtype == jax.numpy.uint8
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    )


def _uses_draft_model(config: EngineConfig) -> bool:
    return config.speculative is not None and config.speculative.method == "draft_model"


def _build_draft(config: EngineConfig, target: LoadedModel, cache_dir: str | None) -> DraftModelProposer:
    """Load speculative_config.model in the target's dtype, check that it speaks the target's vocabulary,
    and give it a runner and a cache of its own (spec_decode/draft_model.py)."""
    spec, sched, cache = config.speculative, config.scheduler, config.cache
    where = f"speculative_config.model={spec.model!r}"
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"{where}: a draft model is served with tensor_parallel_size 1 only")
    try:
        source = open_model(
            resolve_model(ModelSpec(model=spec.model, dtype=jax.numpy.dtype(target.dtype).name))
        )
    except ModelNotFoundError as e:  # the same one-line error `jaxllm serve` prints, naming the key
        raise ModelNotFoundError(f"{where}: {e}") from e
    draft = load_weights(source, config.runner.attention_backend)
    check_draft_vocabulary(where, draft, target)
    seqs = min(sched.max_num_seqs, max_speculating_requests(spec))
    arch = draft.arch
    runner = ModelRunner(
        draft.module,
        draft.params,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        kv_dtype=kv_page_dtype("auto", draft.dtype),
        block_size=cache.block_size,
        # a request's proposals reach k - 1 positions past its last token
        max_model_len=sched.max_model_len + spec.num_speculative_tokens,
        max_num_seqs=seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        bucket_pages=config.runner.attention_backend == "reference",
        bucket_growth=config.runner.bucket_growth,
    )
    num_blocks, why = draft_num_blocks(runner, cache.gpu_memory_utilization, seqs)
    runner.allocate_kv_cache(num_blocks)
    logger.info(
        "draft model %s (%s, %.3f GiB of weights): %d speculative tokens per step; its KV cache: %s",
        draft.model_name, arch.architecture, draft.weight_bytes / 2**30, spec.num_speculative_tokens, why,
    )  # fmt: skip
    return DraftModelProposer(runner, num_blocks, spec.num_speculative_tokens, sched.max_num_batched_tokens)


def check_draft_vocabulary(where: str, draft: LoadedModel, target: LoadedModel) -> None:
    """Every id the draft can propose must mean the same token to the target: its vocabulary no larger,
    and where both have a tokenizer, the same token strings."""
    if draft.arch.vocab_size > target.arch.vocab_size:
        raise ValueError(
            f"{where}: its vocabulary has {draft.arch.vocab_size} tokens, more than the model's "
            f"{target.arch.vocab_size}; a draft model must share the model's tokenizer"
        )
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"{where}: its tokenizer differs from the model's; a draft model must share it")


def kv_scales_source(params) -> str:
    """Where an fp8 cache's per-layer scales come from, for the log: the checkpoint's `k_scale` /
    `v_scale` params, or 1.0 for every layer (vLLM's default when a checkpoint has none)."""
    names = {getattr(path[-1], "key", None) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    return "checkpoint" if {"k_scale", "v_scale"} & names else "1.0"


def grammar_compiler(loaded: LoadedModel) -> GrammarCompiler | None:
    """Structured outputs' grammar compiler for this model's tokenizer (None without a tokenizer), shared
    by the engine (which compiles a request's grammar before it is scheduled) and the runner."""
    if loaded.tokenizer is None:
        return None
    eos = list(loaded.arch.eos_token_ids or [])
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        eos = [tok_eos] + [e for e in eos if e != tok_eos]
    return GrammarCompiler(loaded.tokenizer, loaded.arch.vocab_size, eos)


def quantization_description(arch) -> str | None:
    """The model's scheme for the start-up report: one for all layers, or a count per kind (GGUF)."""
    if arch.layer_quant is None:
        return arch.quant.describe() if arch.quant else None
    kinds: dict[str, int] = {}
    for lq in arch.layer_quant:
        for s in (lq.default, *(s for _, s in lq.overrides)):
            name = s.describe() if s else "float"
            kinds[name] = kinds.get(name, 0) + 1
    return "; ".join(f"{name} x{n}" for name, n in kinds.items())


def device_description(platform: Platform) -> str:
    """e.g. "NVIDIA H100 80GB HBM3 x1 (jax platform gpu, 79.2 GiB)", "cpu x1 (jax platform cpu)"."""
    memory = (
        f", {platform.device_memory_bytes / 2**30:.1f} GiB"
        if platform.device_memory_bytes is not None
        else ""
    )
    return f"{platform.device_kind} x{platform.num_devices} (jax platform {platform.name}{memory})"


def startup_lines(config: EngineConfig, platform: Platform, info: dict, kv_sizing: str) -> list[str]:
    """What the engine runs with, from the resolved config: its settings, its limits (once: nowhere else in
    the log) and the request sampling defaults. `kv_sizing` says how the KV cache's size was decided."""
    sched, cache, runner = config.scheduler, config.cache, config.runner
    settings = {
        "model": info["model"],
        "dtype": info["dtype"],
        "weight_gib": info["weight_gib"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        **({"kv_cache_scales": info["kv_cache_scales"]} if "kv_cache_scales" in info else {}),
        "attention_backend": runner.attention_backend,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "scheduling_policy": sched.policy,
        "async_scheduling": sched.async_scheduling,
        "compile_ahead": runner.compile_ahead,
        "executable_cache": runner.executable_cache,
        "compilation_cache_dir": runner.compilation_cache_dir,
    }
    if info["quantization"]:
        settings["quantization"] = info["quantization"]
    if platform.name != "cpu":  # the host's KV budget does not come from this fraction
        settings["gpu_memory_utilization"] = cache.gpu_memory_utilization
    if cache.swap_space_gib:
        settings["swap_space"] = cache.swap_space_gib
    defaults = config.generation.values
    return [
        "engine config: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        f"limits: max_model_len={sched.max_model_len}, max_num_seqs={sched.max_num_seqs}, "
        f"max_num_batched_tokens={sched.max_num_batched_tokens}, KV cache blocks={info['num_gpu_blocks']} "
        f"of {cache.block_size} tokens ({info['kv_cache_gib']:.3f} GiB; {kv_sizing}), maximum concurrency "
        f"{info['max_concurrency']:.2f}x at {sched.max_model_len} tokens per request",
        "sampling defaults for requests that leave them out: "
        + (
            f"{', '.join(f'{k}={v}' for k, v in defaults.items())} (from {config.generation.source})"
            if defaults
            else f"none, SamplingParams' own apply ({config.generation.source})"
        ),
    ]
