"""Compiled step executables kept on disk, so a warm start loads them without tracing or lowering.

JAX's persistent compilation cache (which the engine also uses) is keyed by the lowered program, so a
start-up on a warm cache still traces and lowers every variant; only XLA's compilation is skipped. That
Python work runs under the GIL, one variant at a time, and costs most of a second per model-step variant
(more for one that holds a Mosaic kernel, whose lowering is slow): with a server's dozens of variants it
was most of a warm start (docs/performance.md gives the start-up times with and without this cache).

This cache sits in front of it. An entry's key is the SHA-256 of:
  - the environment: the engine's own source (every .py file under jaxllm/), the jax
    and jaxlib versions, the platform, device kind and count, XLA_FLAGS, and the jax options that change
    programs (matmul precision, x64);
  - the variant: the caller's description of it (which function, static arguments, compiler options,
    the model module's configuration) and the abstract arguments (shapes, dtypes, shardings).
A hit deserializes the executable (jax.experimental.serialize_executable); a miss compiles as before and
stores the result. An entry that fails to load counts as a miss and is rewritten.

Entries live in one folder per environment (`<directory>/<environment digest>/`). Every edit or upgrade
starts a new one, and an entry is megabytes (the program and its kernels' binaries), so the first store of
a process removes the folders of other environments untouched for STALE_AFTER_S (an hour: not those of a
server of another version starting beside this one; one that is running has its executables loaded
already and only compiles again at its next start).

Code changed at run time (a function patched in a notebook) is not in the key: the engine turns this
cache on for the API server, and LLM(...) only when asked (executable_cache=True).

GPU only (`supported`): on the CPU an executable that JAX loaded from its own persistent cache does not
survive a second serialization (it runs, then fails with "Function wrapped_iota not found"), and a
start-up whose JAX cache is warm stores exactly those.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

logger = logging.getLogger("jaxllm")

_SOURCE_PACKAGES = ("jaxllm",)
STALE_AFTER_S = 3600.0  # another environment's folder untouched this long is removed (module docstring)


def supported() -> bool:
    """Whether executables of this platform are kept (module docstring: GPU only)."""
    return jax.default_backend() == "gpu"


@functools.cache
def source_digest() -> str:
    """SHA-256 over the engine's Python source files (path and content), computed once per process."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment_digest() -> str:
    """What every entry's program depends on besides its own description (module docstring)."""
    dev = jax.devices()[0]
    parts = (
        source_digest(),
        jax.__version__,
        jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        dev.platform,
        getattr(dev, "device_kind", ""),
        jax.device_count(),
        os.environ.get("XLA_FLAGS", ""),
        str(jax.config.jax_default_matmul_precision),
        bool(jax.config.jax_enable_x64),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe_args(args) -> str:
    """The abstract arguments: tree structure, shapes, dtypes and shardings (what the program is for)."""
    leaves, tree = jax.tree.flatten(args)
    return repr(
        (str(tree), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves])
    )


class ExecutableCache:
    """Executables under `directory` (None: a cache that never hits and stores nothing)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.root = Path(directory) if directory else None
        self.hits = 0
        self.misses = 0
        self._env = environment_digest() if self.root else ""
        # This environment's entries (None: disabled).
        self.directory = self.root / self._env[:32] if self.root else None
        self._swept = False

    def key(self, description: str) -> str:
        return hashlib.sha256(f"{self._env}\n{description}".encode()).hexdigest()

    def contains(self, description: str) -> bool:
        """Whether an entry is stored under `description` (it may still fail to load)."""
        return self.directory is not None and (self.directory / f"{self.key(description)}.exe").exists()

    def get_or_compile(self, description: str, compile_fn: Callable[[], jax.stages.Compiled]):
        """The executable stored under `description` (with the environment), or compile_fn()'s result,
        stored for next time."""
        if self.directory is None:
            return compile_fn()
        path = self.directory / f"{self.key(description)}.exe"
        exe = self._load(path)
        if exe is not None:
            self.hits += 1
            return exe
        self.misses += 1
        exe = compile_fn()
        self._store(path, exe)
        return exe

    def _load(self, path: Path):
        try:
            with open(path, "rb") as fp:
                payload, in_tree, out_tree = pickle.load(fp)
            return deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception:  # a truncated or stale file: compile instead, and the store replaces it
            logger.warning("executable cache: %s did not load; compiling instead", path, exc_info=True)
            return None

    def remove_stale(self) -> list[str]:
        """Remove the folders of other environments untouched for STALE_AFTER_S; their names."""
        if self.root is None or not self.root.is_dir():
            return []
        removed, now = [], time.time()
        for d in self.root.iterdir():
            if d.is_dir() and d != self.directory and now - d.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
        if removed:
            logger.info("executable cache: removed %d folders of other source or versions", len(removed))
        return removed

    def _store(self, path: Path, exe) -> None:
        if not self._swept:
            self._swept = True
            self.remove_stale()
        try:
            data = pickle.dumps(serialize(exe))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written whole under a temporary name, then renamed: a reader never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fp:
                    fp.write(data)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception:  # an executable that cannot be serialized still runs; it just is not kept
            logger.warning("executable cache: could not store %s", path, exc_info=True)
