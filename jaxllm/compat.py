"""Every private API of jax, flax, transformers and the standard library that jaxllm uses, in one place.

Each function names what it reaches into and falls back (or raises) when an upgrade moves it;
tests/test_compat.py calls each one against the installed versions, so an upgrade that breaks one fails
there by name instead of deep inside a step. Nothing else in jaxllm touches these private names.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable


def jit_cache_size(fn) -> int:
    """How many programs a `jax.jit` function has traced and compiled (`PjitFunction._cache_size`)."""
    size = getattr(fn, "_cache_size", None)
    if size is None:
        raise RuntimeError("jax.jit functions no longer expose _cache_size(); update jaxllm.compat")
    return int(size())


def register_atexit_before_thread_pools(fn: Callable[[], None]) -> None:
    """Run `fn` at interpreter exit before concurrent.futures joins its worker threads
    (`threading._register_atexit`: these hooks run last-registered first, before the pools' own)."""
    hook = getattr(threading, "_register_atexit", None)
    if hook is None:
        raise RuntimeError("threading._register_atexit is gone; update jaxllm.compat")
    hook(fn)


def distributed_client():
    """The key-value client of the coordinator `jax.distributed.initialize` joined, or None when this
    process runs alone (`jax._src.distributed.global_state.client`)."""
    from jax._src.distributed import global_state

    return global_state.client


def jax_backend_errors() -> dict[str, str]:
    """Why each backend JAX tried without being told to (JAX_PLATFORMS unset) failed to start, once its
    backends have started (`jax._src.xla_bridge._backend_errors`, platform -> message): where a CUDA plugin
    that did not start says why. Empty when JAX no longer keeps it."""
    from jax._src import xla_bridge

    return dict(getattr(xla_bridge, "_backend_errors", None) or {})


def flax_interceptors_active() -> bool:
    """Whether an `nn.intercept_methods` context is open (flax keeps a thread-local
    `_global_interceptor_stack` in flax.linen.module)."""
    from flax.linen import module as linen_module

    if not hasattr(linen_module, "_global_interceptor_stack"):
        raise RuntimeError("flax.linen.module._global_interceptor_stack is gone; update jaxllm.compat")
    return bool(linen_module._global_interceptor_stack)


def rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (`_tokenizer`), or None."""
    return getattr(tokenizer, "_tokenizer", None)


def rust_decoder(tokenizer):
    """The `tokenizers.Tokenizer` that decodes for `tokenizer`, when its `decode` with cleaning off is
    exactly that tokenizer's decode: a transformers fast tokenizer whose class does not override the
    private `_decode` that transformers' fast tokenizer class defines. None otherwise (slow tokenizers,
    wrappers, classes with their own decoding), and None when transformers no longer defines `_decode`
    there, so decoding falls back to the tokenizer's public `decode`."""
    rust = rust_tokenizer(tokenizer)
    if rust is None or not callable(getattr(rust, "decode", None)):
        return None
    from transformers import PreTrainedTokenizerFast

    plain = _decode_owner(PreTrainedTokenizerFast)
    if plain is None or _decode_owner(type(tokenizer)) is not plain:
        return None
    return rust


def _decode_owner(cls: type) -> type | None:
    """The class in `cls`'s MRO whose `_decode` `cls` uses."""
    return next((c for c in cls.__mro__ if "_decode" in vars(c)), None)


def argparse_option_actions(parser) -> dict:
    """{"--flag": argparse.Action} for every option string of `parser` (argparse keeps this table in a
    private attribute and has no public accessor; a config file's keys are checked against it)."""
    return dict(parser._option_string_actions)


def jax_cache_interface() -> type:
    """The base class of JAX's persistent compilation caches (`jax._src.compilation_cache_interface
    .CacheInterface`: get(key) -> bytes | None, put(key, bytes))."""
    from jax._src.compilation_cache_interface import CacheInterface

    return CacheInterface


def install_jax_compilation_cache(cache) -> None:
    """Make `cache` (a jax_cache_interface() instance) the persistent compilation cache JAX reads and
    writes (`jax._src.compilation_cache._cache`, which JAX otherwise fills with its own LRUCache on first
    use). Call it after setting `jax_compilation_cache_dir`, before the first compile."""
    from jax._src import compilation_cache

    if not hasattr(compilation_cache, "_cache") or not hasattr(compilation_cache, "_cache_initialized"):
        raise RuntimeError("jax._src.compilation_cache._cache is gone; update jaxllm.compat")
    compilation_cache.reset_cache()
    compilation_cache._cache = cache
    compilation_cache._cache_initialized = True


# a Pallas Triton kernel whose name ends so asks for its loops' loads pipelined over that many stages
LOOP_STAGES_SUFFIX = re.compile(r"_loopstages(\d+)$")


def pipeline_named_triton_loops() -> None:
    """Have Triton software-pipeline the loads of every loop of each Pallas Triton kernel whose name ends
    in `_loopstages{n}` (LOOP_STAGES_SUFFIX), over n stages: asynchronous copies into shared memory issued
    n - 1 iterations ahead. Idempotent.

    Triton pipelines the loads of a loop that has no dot only when the loop carries `tt.num_stages` (what
    `tl.range(..., num_stages=n)` sets); Pallas' Triton lowering sets none, so such a kernel's loads wait
    for memory at every step. This wraps Pallas' `lower_jaxpr_to_triton_module`
    (`jax._src.pallas.triton.lowering`, which `pallas_call_registration` calls) to put the attribute on
    the `scf.for` ops of those modules. The kernels ask by name because they import nothing of jaxllm."""
    from jax._src.pallas.triton import lowering

    emit = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if emit is None:
        raise RuntimeError(
            "jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module is gone; update jaxllm.compat"
        )
    if getattr(emit, "jaxllm_loop_stages", False):
        return

    def lower_with_loop_stages(*args, **kwargs):
        result = emit(*args, **kwargs)
        op = result.module.operation
        name = op.attributes["sym_name"].value if "sym_name" in op.attributes else ""
        m = LOOP_STAGES_SUFFIX.search(name)
        if m and int(m.group(1)) > 1:
            from jax._src.lib.mlir import ir

            with result.module.context:
                _set_on_loops(op, ir.IntegerAttr.get(ir.IntegerType.get_signless(32), int(m.group(1))))
        return result

    lower_with_loop_stages.jaxllm_loop_stages = True
    lowering.lower_jaxpr_to_triton_module = lower_with_loop_stages


def _set_on_loops(op, attr) -> None:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "scf.for":
                    inner.operation.attributes["tt.num_stages"] = attr
                _set_on_loops(inner.operation, attr)
