"""Quantized checkpoints of the embedded model made by the real tools, for tests that compare jaxllm with
transformers on them: `ensure_quant_checkpoints()` returns the cache folder, building what is missing.

  cache (JAXLLM_QUANT_TOOLS_DIR, default ~/.cache/jaxllm/quant-tools)
    venv/                     the tools' own environment (scripts/quant_checkpoints/requirements.txt;
                              llm-compressor's pins conflict with jaxllm's), stamped with the file's hash
    manifest.json             per checkpoint: tool and version, scheme, build times
    checkpoints/<name>/       Hugging Face folder + reference.json, tool_metadata.json,
                              layer0_dense.reference (scripts/quant_checkpoints/references.py)

A cache built by the current recipe is returned as is, without the tools (no network needed). Otherwise
the venv is (re)created and scripts/quant_checkpoints/build.py runs inside it. When that install fails
and the package index cannot be reached, QuantToolsUnavailable is raised (tests skip on it); any other
failure is an error, since with a network the tools must install and run.

Interpreter for the venv: JAXLLM_QUANT_TOOLS_PYTHON if set, else Python 3.11, else 3.12, else this
interpreter. 3.11 first because PyPI's Linux torch is the CUDA build (gigabytes) for every Python, while
machines that keep a CPU wheel of torch in pip's find-links (the CI machines do, for 3.11) install that
one in seconds; the tools themselves run on 3.11 and 3.12 alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts" / "quant_checkpoints"
REQUIREMENTS = SCRIPTS_DIR / "requirements.txt"
DEFAULT_TIMEOUT_S = 1800  # install + build of everything on two cores, with room for a slow index
_STAMP = ".jaxllm-requirements-sha256"


class QuantToolsUnavailable(RuntimeError):
    """No cache of the checkpoints and no network to install the tools that build them."""


def cache_dir() -> Path:
    root = os.environ.get("JAXLLM_QUANT_TOOLS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "jaxllm" / "quant-tools"


@functools.cache
def _build_module() -> ModuleType:
    """build.py, loaded from this environment: its top level is standard library only."""
    path = SCRIPTS_DIR / "build.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the quantized checkpoints are built from a jaxllm checkout"
        )
    spec = importlib.util.spec_from_file_location("jaxllm_quant_checkpoints_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def checkpoint_names() -> list[str]:
    return list(_build_module().CHECKPOINTS)


def _requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def _tools_interpreter() -> str:
    explicit = os.environ.get("JAXLLM_QUANT_TOOLS_PYTHON")
    if explicit:
        return explicit
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for minor in ("3.11", "3.12"):
        for candidate in sorted((pyenv_root / "versions").glob(f"{minor}*/bin/python{minor}"), reverse=True):
            return str(candidate)
        found = shutil.which(f"python{minor}")
        if found:
            return found
    return sys.executable


def _index_reachable(host: str = "pypi.org", port: int = 443, timeout_s: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout_s, env=env)


def _ensure_venv(cache: Path, timeout_s: float) -> Path:
    """The tools' venv with the pinned requirements; recreated when requirements.txt changed."""
    venv = cache / "venv"
    python = venv / "bin" / "python"
    wanted = _requirements_hash()
    stamp = venv / _STAMP
    if python.is_file() and stamp.is_file() and stamp.read_text().strip() == wanted:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    log = cache / "install.log"
    log.write_text("")
    try:
        _run_logged([_tools_interpreter(), "-m", "venv", str(venv)], log, timeout_s)
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        _run_logged(
            [str(python), "-m", "pip", "install", "--no-cache-dir", "-r", str(REQUIREMENTS)],
            log,
            timeout_s,
            env,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        shutil.rmtree(venv, ignore_errors=True)
        if not _index_reachable():
            raise QuantToolsUnavailable(
                f"the quantization tools could not be installed (no network: pypi.org unreachable) and "
                f"{cache} holds no checkpoints built by the current recipe"
            ) from e
        raise RuntimeError(f"installing the quantization tools failed ({e}); {log}:\n{_tail(log)}") from e
    stamp.write_text(wanted + "\n")
    return python


@contextlib.contextmanager
def _locked(cache: Path):
    """One builder at a time per cache (parallel test processes wait for the first one)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_quant_checkpoints(names=None, timeout_s: float | None = None) -> Path:
    """The cache folder, holding each named checkpoint (default: all) built by the current recipe."""
    build = _build_module()
    names = list(names or build.CHECKPOINTS)
    unknown = sorted(set(names) - set(build.CHECKPOINTS))
    if unknown:
        raise ValueError(f"unknown quantized checkpoint(s) {unknown}; known: {sorted(build.CHECKPOINTS)}")
    cache = cache_dir()
    if build.is_complete(cache, names):
        return cache
    if timeout_s is None:
        timeout_s = float(os.environ.get("JAXLLM_QUANT_TOOLS_TIMEOUT", DEFAULT_TIMEOUT_S))
    with _locked(cache):
        if build.is_complete(cache, names):
            return cache
        python = _ensure_venv(cache, timeout_s)
        from jaxllm.embedded import embedded_model_path

        cmd = [
            str(python),
            str(SCRIPTS_DIR / "build.py"),
            "--cache",
            str(cache),
            "--gguf",
            embedded_model_path(),
        ]
        for name in names:
            cmd += ["--only", name]
        log = cache / "build.log"
        log.write_text("")
        try:
            _run_logged(cmd, log, timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(
                f"building the quantized checkpoints failed ({e}); {log}:\n{_tail(log)}"
            ) from e
    if not build.is_complete(cache, names):
        raise RuntimeError(f"build.py finished but {cache} lacks some of {names}; see {cache / 'build.log'}")
    return cache


def checkpoint_dir(name: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "checkpoints" / name
