"""The checked persistent compilation cache (jaxllm/runner/compilation_cache.py) as JAX uses it, in a child
process per start (JAX initializes its cache once per process): a cold start stores, a warm start loads
(hits, no stores) with the same results as plain jnp; an entry overwritten with garbage, truncated, or
intact but not loadable is logged with its path and rewritten; a write that fails is counted, not raised (the
real ENOSPC, with a server, is in tests/server/test_soak_and_faults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxllm.runner.compilation_cache import MAGIC, SUFFIX, CheckedFileCache, _check

REPO = Path(__file__).resolve().parents[2]
CHILD = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
import jax, jax.numpy as jnp, numpy as np
from jaxllm.engine.builder import enable_compilation_cache
from jaxllm.runner import compilation_cache
enable_compilation_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
x = jnp.linspace(-2.0, 2.0, 64, dtype=jnp.float32)
got = jax.jit(lambda v: jnp.tanh(v) * 3.0 + jnp.exp(-v * v))(x)
want = np.tanh(np.asarray(x)) * 3.0 + np.exp(-np.asarray(x) ** 2)
print(json.dumps({"close": bool(np.allclose(got, want, atol=1e-5)),
                  "counts": compilation_cache.counts().__dict__}))
"""


def start(directory: Path) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["close"]
    return out["counts"], p.stderr


def test_cold_warm_corrupt_and_unwritable(tmp_path):
    d = tmp_path / "xla"
    cold, _ = start(d)
    assert cold["stores"] >= 1 and cold["hits"] == 0 and cold["misses"] == cold["stores"]
    entries = sorted(d.glob(f"*{SUFFIX}"))
    assert len(entries) == cold["stores"]

    warm, _ = start(d)
    assert warm == {"hits": cold["stores"], "misses": 0, "stores": 0, "corrupt": 0, "write_errors": 0}

    for damage in (
        lambda p: p.write_bytes(b"\x00garbage" * 100),
        lambda p: os.truncate(p, p.stat().st_size // 2),
    ):
        target = max(entries, key=lambda p: p.stat().st_size)
        damage(target)
        counts, log = start(d)
        assert f"compilation cache: {target} is corrupt" in log
        assert counts["corrupt"] == 1 and counts["stores"] == 1 and counts["hits"] == len(entries) - 1
        assert _check(target.read_bytes()) is None  # rewritten whole

    # Intact checksum, payload JAX cannot load: JAX compiles again and the entry is replaced.
    target = max(entries, key=lambda p: p.stat().st_size)
    payload = b"not an executable"
    import hashlib

    target.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    counts, log = start(d)
    assert f"compilation cache: {target} did not load; replacing it" in log
    assert counts["corrupt"] == 1 and counts["stores"] == 1
    assert start(d)[0]["hits"] == len(entries)


def test_check_names_what_is_wrong(tmp_path):
    import hashlib

    payload = b"x" * 100
    good = MAGIC + hashlib.sha256(payload).digest() + payload
    assert _check(good) is None
    assert "shorter than a header" in _check(good[:10])
    assert "no jaxllm header" in _check(b"Z" + good[1:])
    assert "checksum mismatch over 50 bytes" in _check(good[:-50])
    cache = CheckedFileCache(tmp_path)
    assert cache.get("k") is None and cache.counts.misses == 1
    cache.put("k", payload)
    assert cache.get("k") == payload and cache.counts.hits == 1
    # A write that fails (here: the folder is gone) is counted and logged, not raised into JAX.
    gone = CheckedFileCache(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    gone.put("k", payload)
    assert gone.counts.write_errors == 1 and gone.counts.stores == 0
