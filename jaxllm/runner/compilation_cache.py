"""JAX's persistent compilation cache, with entries that are checked on read and written whole.

JAX's own file cache writes an entry in place (`write_bytes`) and never rewrites one that exists. A process
killed mid-write, or a disk that fills up mid-write, leaves half a file; JAX then fails to read it at every
later start (a warning that names the program, not the file), compiles again, and keeps the broken file,
since a key that exists is never written twice. An executable that decompresses but no longer loads (an
entry written by a jaxlib it does not match) is kept the same way.

This cache takes its place (`install(directory)`), in the same folder, with the same keys:
  - an entry is `MAGIC + sha256(payload) + payload`, where payload is the bytes JAX hands to put();
  - put() writes a temporary file and renames it, so a reader sees a whole entry or none; a failed write
    (ENOSPC, a read-only folder) removes the temporary file, logs the path and the reason, and returns:
    the program was compiled and runs, it is only not kept;
  - get() checks the magic and the digest; an entry that fails is logged with its path, removed, and
    reported as a miss, so JAX compiles and put() writes a good one;
  - a put() for a key this process got a hit for means JAX could not load that entry (it compiled instead):
    the entry is replaced.
Counts of each (`CacheCounts`) go to the engine's stats and /metrics, so a warm restart shows as hits
and no stores, and a corrupt entry or a full disk shows as a count, not only as a log line.

Entries of JAX's own format (`<key>-cache`) in the same folder are never read: a folder JAX's cache wrote
is cold once for this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from jaxllm.compat import install_jax_compilation_cache, jax_cache_interface

logger = logging.getLogger("jaxllm")

MAGIC = b"JAXLLMX1"
_DIGEST = 32  # sha256
SUFFIX = ".xla"
_STALE_TMP_S = 3600.0  # a temporary file older than this was left by a process that died mid-write


@dataclasses.dataclass(frozen=True)
class CacheCounts:
    """Cumulative counts of this process's persistent compilation cache (module docstring)."""

    hits: int = 0  # entries read and handed to JAX
    misses: int = 0  # lookups that found no entry
    stores: int = 0  # entries written
    corrupt: int = 0  # entries that failed their check (or failed to load) and were removed or replaced
    write_errors: int = 0  # entries that could not be written (full disk, read-only folder)


def entry_path(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / f"{key}{SUFFIX}"


def _check(data: bytes) -> str | None:
    """Why `data` is not a whole entry, or None when it is."""
    if len(data) < len(MAGIC) + _DIGEST:
        return f"{len(data)} bytes, shorter than a header"
    if not data.startswith(MAGIC):
        return "no jaxllm header"
    view = memoryview(data)  # hashed in place: an executable can be tens of MB, copied once on a hit
    digest, payload = view[len(MAGIC) : len(MAGIC) + _DIGEST], view[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(payload).digest() != digest:
        return f"checksum mismatch over {len(payload)} bytes (truncated or overwritten)"
    return None


class CheckedFileCache(jax_cache_interface()):
    """JAX's CacheInterface over one folder (module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        self._path = Path(directory)
        self._path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # JAX compiles on several threads (compile_all's pool)
        self._counts = CacheCounts()
        self._served: set[str] = set()  # keys this process got a hit for
        self._remove_stale_temporaries()

    @property
    def counts(self) -> CacheCounts:
        return self._counts

    def _count(self, **deltas: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = dataclasses.replace(c, **{k: getattr(c, k) + v for k, v in deltas.items()})

    def get(self, key: str) -> bytes | None:
        path = entry_path(self._path, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as e:
            logger.warning("compilation cache: cannot read %s (%s); compiling instead", path, e)
            self._count(misses=1)
            return None
        why = _check(data)
        if why is not None:
            logger.warning("compilation cache: %s is corrupt (%s); removed it, compiling instead", path, why)
            path.unlink(missing_ok=True)
            self._count(corrupt=1, misses=1)
            return None
        with self._lock:
            self._served.add(key)
        self._count(hits=1)
        return data[len(MAGIC) + _DIGEST :]

    def put(self, key: str, value: bytes) -> None:
        path = entry_path(self._path, key)
        with self._lock:
            reloaded = key in self._served
            self._served.discard(key)
        if reloaded:  # JAX got this entry from get() and compiled anyway: it did not load
            logger.warning("compilation cache: %s did not load; replacing it with the new compile", path)
            self._count(corrupt=1)
        elif path.exists():
            return
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self._path, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(value).digest() + value)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            logger.warning(
                "compilation cache: could not write %s (%s); serving goes on, this program compiles again "
                "at the next start",
                path,
                e,
            )
            self._count(write_errors=1)
        else:
            self._count(stores=1)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _remove_stale_temporaries(self) -> None:
        now = time.time()
        for tmp in self._path.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()


_installed: CheckedFileCache | None = None


def install(directory: str) -> CheckedFileCache:
    """Make a CheckedFileCache over `directory` JAX's persistent compilation cache (once per process and
    folder: a later call for the same folder returns the same cache, so its counts go on)."""
    global _installed
    if _installed is None or _installed._path != Path(directory):
        _installed = CheckedFileCache(directory)
    install_jax_compilation_cache(_installed)
    return _installed


def counts() -> CacheCounts:
    """The installed cache's counts (all zero when none is installed)."""
    return _installed.counts if _installed is not None else CacheCounts()
