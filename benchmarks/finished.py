"""No throughput figure from a run that lost requests.

    a benchmark's run --require_all_finished(what, finished, total, errors)--> nothing, or IncompleteRun
    `python -m benchmarks.X` --exit_on_incomplete(main)--> the message on stderr and exit status 1

Tokens divided by the time of a run in which requests failed measure the failure, not the engine: a peer
whose generation thread died at once "served" 65,536 prompt tokens in 50 ms. So a benchmark counts the
requests that finished, and unless all did it prints and saves no throughput: it raises IncompleteRun,
whose message says how many finished and the first errors, and its command exits non-zero.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any


class IncompleteRun(RuntimeError):
    """Not every request of a timed run finished; the run's throughput is not reported."""

    def __init__(self, what: str, finished: int, total: int, errors: Sequence[str] = ()):
        self.what, self.finished, self.total = what, finished, total
        self.errors = list(dict.fromkeys(e for e in errors if e))[:3]
        detail = f" (first errors: {'; '.join(self.errors)})" if self.errors else ""
        super().__init__(
            f"{what}: {finished} of {total} requests finished; no throughput is reported for a run in "
            f"which requests did not finish{detail}"
        )


def require_all_finished(what: str, finished: int, total: int, errors: Sequence[str] = ()) -> None:
    """Raise IncompleteRun unless `finished` == `total` (and there was at least one request)."""
    if total < 1 or finished != total:
        raise IncompleteRun(what, finished, total, errors)


def exit_on_incomplete(main: Callable[[], Any]) -> None:
    """Run a benchmark's main; an IncompleteRun ends the process with its message and status 1."""
    try:
        main()
    except IncompleteRun as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
