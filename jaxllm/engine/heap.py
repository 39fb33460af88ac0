"""The Python heap of a long-running engine and the cyclic garbage collector.

An engine keeps every request's token lists and bookkeeping objects alive while it runs, and the step
thread allocates on every step, so the collector's oldest generation comes round every few seconds and
walks every tracked object: the weights' and compiled steps' Python objects from start-up included. On
the development CPU, 1,000 requests of 128 + 32 tokens on a tiny model: two full collections of 108 ms
each, on the host's critical path of the step they land in (a device idle for that long, a 100 ms
inter-token gap for every stream). vLLM's engine does the same as `freeze_startup_heap`: once start-up is
done, collect, then freeze what is left, so full collections skip it (there: 2 x 28 ms). On the H200,
Llama-3.1-8B shape, 1,000 prompts 512 -> 256 in one call: 9,854 output tok/s frozen against 9,720 with the
freeze undone (benchmarks/results/2026-12-03-h200-throughput-llama8b-1000x512x256-gc-*.json).

Tried and dropped: collecting the youngest generation every 50,000 allocations instead of 700 while an
engine loop runs. On the development CPU it cut the scheduler's host time by half; on the H200 the
server's host time per step grew (dispatch at concurrency 32: 3.87 ms against 2.77, c=32 TPOT 7.19
against 6.03 ms, one launch each) and the offline run's host work with it
(benchmarks/results/2026-12-03-h200-young-gc-threshold-ab.log).
"""

from __future__ import annotations

import gc


def collect_dropped_engines() -> None:
    """Unfreeze and collect what an earlier engine's start-up froze, so an engine dropped since (its KV
    cache and weights are cyclic garbage) frees its device memory before a new engine allocates its own:
    called first thing by every engine's start-up. A no-op when nothing is frozen."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now into the collector's permanent generation. Objects an
    earlier call froze are unfrozen first, so an engine dropped since (a notebook building a second one,
    a script comparing two) is collected here rather than kept, cycles and device buffers included.
    Returns the number of frozen objects."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
