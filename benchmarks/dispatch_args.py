"""Host cost of one jitted call against its number of array arguments (the engine's model step takes
about 355: 291 weights and 64 KV-cache pages at Llama-3.1-8B, donated pages among them).

    python -m benchmarks.dispatch_args --counts 1,16,64,128,256,355

For each count N: a jitted function of N small device arrays that adds one to the first and returns it,
its output fed back as the next call's first argument (a chain, as the engine's steps are). Measured: the
median time for the call to return (the host's dispatch; the device work is one tiny kernel), and the
same with the last min(N - 1, 64) arguments donated and returned updated (as the KV-cache pages are).
The slope over N is the per-argument cost that every model step pays on the host.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.workload import make_result, save_result


def time_dispatch(n: int, donated: int, calls: int) -> float:
    """Median seconds for one call of a jitted function of n arrays, `donated` of them donated."""
    import jax
    import jax.numpy as jnp

    keep = n - donated

    def step(*args):
        head = args[0] + 1
        return (head, *[a + 1 for a in args[keep:]]) if donated else head

    fn = jax.jit(step, donate_argnums=tuple(range(keep, n)))
    args = [jnp.full((256,), i, jnp.float32) for i in range(n)]
    times = []
    for i in range(calls + 5):
        t0 = time.perf_counter()
        out = fn(*args)
        if i >= 5:  # the first calls compile
            times.append(time.perf_counter() - t0)
        if donated:
            args = [out[0], *args[1:keep], *out[1:]]
        else:
            args = [out, *args[1:]]
    jax.block_until_ready(args)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1,16,64,128,256,355")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for n in (int(c) for c in args.counts.split(",")):
        donated = min(n - 1, 64)
        row = {
            "args": n,
            "dispatch_us": time_dispatch(n, 0, args.calls) * 1e6,
            "donated": donated,
            "dispatch_donated_us": time_dispatch(n, donated, args.calls) * 1e6 if donated else None,
        }
        rows.append(row)
        print(
            f"{n:4d} arrays: {row['dispatch_us']:8.1f} us per call"
            + (f"; {donated} of them donated: {row['dispatch_donated_us']:8.1f} us" if donated else "")
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        slope = (last["dispatch_us"] - first["dispatch_us"]) / (last["args"] - first["args"])
        print(f"about {slope:.2f} us per argument")
    result = make_result("dispatch_args", "dispatch-args", None, vars(args), {"rows": rows}, None)
    if not args.no_save:
        print(f"saved {save_result(result, args.output_json)}")
    return result


if __name__ == "__main__":
    main()
