"""The Python heap of a long-running engine and the cyclic garbage collector.

An engine keeps every request's token lists and bookkeeping objects alive while it runs, and the step
thread allocates on every step, so the collector's oldest generation comes round every few seconds and
walks every tracked object: the weights' and compiled steps' Python objects from start-up included. Such
a full collection takes tens to hundreds of milliseconds and lands on the host's critical path of the
step it interrupts: the device idles that long, and every stream sees one long inter-token gap. vLLM's
engine does the same as `freeze_startup_heap`: once start-up is done, collect, then freeze what is left,
so full collections skip it.

Tried and dropped: collecting the youngest generation far less often (every 50,000 allocations instead
of 700) while an engine loop runs. It halved the scheduler's host time on a small CPU but made the
server's host time per step grow on a GPU host (docs/performance.md), so the interpreter's default stays.
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
