"""jaxllm/engine/heap.py: start-up objects leave the collector's scans; a dropped engine is still collected."""

from __future__ import annotations

import gc
import weakref

from jaxllm import LLM
from jaxllm.engine.heap import freeze_startup_heap


class _Node:
    pass


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # only the cyclic collector can free these two
    return a


def test_freeze_then_collect_a_dropped_cycle_on_the_next_call():
    a = _cycle()
    frozen = freeze_startup_heap()
    # Another thread (an earlier engine's background compiles) may free a frozen object meanwhile, which
    # leaves the permanent generation: the count can only have dropped.
    assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen
    assert not any(o is a for o in gc.get_objects())  # frozen: full collections skip it
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is not None  # frozen cyclic garbage survives a collection...
    freeze_startup_heap()
    assert ref() is None  # ...until the next freeze unfreezes and collects it first


def test_engine_start_freezes_its_heap(tiny_llama_dir, jax_cache_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, compilation_cache_dir=jax_cache_dir)
    engine = llm.llm_engine
    assert engine.startup_info["gc_frozen_objects"] > 0
    assert not any(o is engine.runner for o in gc.get_objects())  # built before the freeze
    gc.unfreeze()


def test_a_dropped_engine_is_freed_before_the_next_one_allocates(tiny_llama_dir, jax_cache_dir, monkeypatch):
    """Its start-up froze the first engine (cycles included): the second engine's start-up must collect it
    before sizing and allocating its own KV cache, or the device runs out of memory."""
    from jaxllm.runner.model_runner import ModelRunner

    kw = dict(dtype="float32", max_model_len=64, compilation_cache_dir=jax_cache_dir)
    first = LLM(tiny_llama_dir, **kw)
    ref = weakref.ref(first.llm_engine.runner)
    del first
    gc.collect()
    assert ref() is not None  # frozen: an ordinary collection leaves it
    alive_at_allocation = []
    allocate = ModelRunner.allocate_kv_cache

    def spy(self, *args, **kwargs):
        alive_at_allocation.append(ref() is not None)
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", spy)
    LLM(tiny_llama_dir, **kw)
    assert alive_at_allocation == [False]
    gc.unfreeze()
