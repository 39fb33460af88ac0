"""The real `jaxllm doctor`, run as a user runs it, in environments made on disk: this machine as it is (a
CPU-only JAX: exit 0 and the installed versions), stub NVIDIA libraries on LD_LIBRARY_PATH beside a pip
wheel's folder holding the same library (exit 1, the shadowing folder and its fix named), and an
`nvidia-smi` on PATH that reports an H100 while JAX has no CUDA plugin (exit 1, JAX fell back to the CPU)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _has_real_gpu() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


pytestmark = pytest.mark.skipif(
    _has_real_gpu() or any(_installed(p) for p in PLUGINS),
    reason="these environments are made on a machine without an NVIDIA GPU and with a CPU-only JAX",
)


def doctor(*args: str, env_changes: dict[str, str | None], pythonpath: tuple[str, ...] = ()):
    """Runs the installed `jaxllm` command (this checkout first on the path) with the environment changed."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "JAX_PLATFORMS", "LD_PRELOAD")}
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(REPO)])
    script = Path(sys.executable).with_name("jaxllm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "jaxllm.server.cli"]
    return subprocess.run(
        [*command, "doctor", *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_a_clean_cpu_environment_passes_and_reports_the_real_versions(tmp_path):
    cache = tmp_path / "xla"
    (cache / "sub").mkdir(parents=True)
    (cache / "sub" / "entry").write_bytes(b"x" * 1000)
    r = doctor("--json", env_changes={"JAXLLM_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    facts = report["facts"]
    assert report["findings"] == [] and report["exit_status"] == 0
    assert facts["python_version"] == platform.python_version()
    for name in ("jax", "jaxlib"):
        assert facts["packages"][name] == importlib.metadata.version(name)
    assert facts["backend"] == "cpu" and facts["devices"][0]["platform"] == "cpu"
    assert facts["gpu_evidence"] == [] and facts["ld_library_path"] == []
    assert facts["compilation_cache"] == {
        "path": str(cache), "exists": True, "files": 1, "bytes": 1000, "writable": True,
    }  # fmt: skip
    wheels = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    assert facts["nvidia_wheels"] == {k: v for k, v in wheels.items() if k.startswith("nvidia-")}

    text = doctor(env_changes={"JAXLLM_CACHE_DIR": str(cache)})
    assert text.returncode == 0 and text.stdout.rstrip().endswith("No problems found.")
    assert (
        f"jax, jaxlib        {importlib.metadata.version('jax')}, {importlib.metadata.version('jaxlib')}"
        in text.stdout
    )


def test_stub_cuda_libraries_on_ld_library_path_are_named_and_fail(tmp_path):
    # A pip wheel's layout (site-packages/nvidia/<component>/lib) holding libcublas.so.12 ...
    site = tmp_path / "site"
    (site / "nvidia" / "cublas" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cublas" / "lib" / "libcublas.so.12").write_bytes(b"")
    # ... and a CUDA toolkit's folder on LD_LIBRARY_PATH with its own copies, before a harmless folder.
    toolkit, other = tmp_path / "cuda" / "lib64", tmp_path / "tools"
    toolkit.mkdir(parents=True)
    other.mkdir()
    for name in ("libcublas.so.12.2.5.6", "libcublasLt.so.12", "libcudart.so.12"):
        (toolkit / name).write_bytes(b"")
    (toolkit / "libcublas.so.12").symlink_to("libcublas.so.12.2.5.6")
    ld = f"{toolkit}:{other}"
    r = doctor(env_changes={"LD_LIBRARY_PATH": ld}, pythonpath=(str(site),))
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("ERROR: LD_LIBRARY_PATH entry")]
    assert line.startswith(f"ERROR: LD_LIBRARY_PATH entry {toolkit} holds libcublas.so.12")
    assert line.endswith(f"Fix: remove {toolkit} from LD_LIBRARY_PATH: export LD_LIBRARY_PATH={other}")
    assert (
        f"LD_LIBRARY_PATH    {toolkit} (libcublas.so.12, libcublasLt.so.12, libcudart.so.12); {other}"
        in r.stdout
    )

    report = json.loads(doctor("--json", env_changes={"LD_LIBRARY_PATH": ld}, pythonpath=(str(site),)).stdout)
    assert report["exit_status"] == 1
    wheel_copy = {(w["soname"], w["path"]) for w in report["facts"]["wheel_libraries"]}
    assert ("libcublas.so.12", str(site / "nvidia/cublas/lib/libcublas.so.12")) in wheel_copy
    (shadow,) = [f for f in report["facts"]["ld_library_path_libraries"] if f["soname"] == "libcublas.so.12"]
    assert shadow["version"] == "12.2.5.6" and shadow["wheel"] is None  # read through the symbolic link

    # The same folder without the wheel's copy to shadow (no nvidia wheel anywhere): nothing to report.
    if not any(d.metadata["Name"].lower().startswith("nvidia-") for d in importlib.metadata.distributions()):
        assert doctor(env_changes={"LD_LIBRARY_PATH": ld}).returncode == 0


def _fake_nvidia_smi(folder: Path) -> None:
    """An nvidia-smi that answers the doctor's query as one H100 on driver 570 does."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in --query-gpu=*) echo "0, NVIDIA H100 80GB HBM3, 570.133.20, 81559, 4";; *) exit 9;; esac\n'
    )
    smi.chmod(0o755)


def test_a_gpu_that_jax_does_not_use_is_a_loud_error_naming_the_install(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin")
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    r = doctor(env_changes={"PATH": path})
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if "FELL BACK" in x]
    assert line.startswith("ERROR: JAX FELL BACK TO THE CPU: 1 x NVIDIA H100 80GB HBM3")
    assert "driver 570.133.20" in line and "no CUDA plugin for JAX is installed" in line
    assert line.endswith("Fix: pip install 'jaxllm[cuda12]'")
    assert (
        "NVIDIA GPU         1 x NVIDIA H100 80GB HBM3, driver 570.133.20; in use: GPU 0 0.0 of 79.6 GiB"
        in r.stdout
    )

    # Asked for on purpose (JAX_PLATFORMS=cpu), the CPU is only a warning.
    r = doctor("--json", env_changes={"PATH": path, "JAX_PLATFORMS": "cpu"})
    report = json.loads(r.stdout)
    assert r.returncode == 0 and [f["level"] for f in report["findings"]] == ["warning"]
    assert report["findings"][0]["fix"] == "unset JAX_PLATFORMS"
    assert report["facts"]["driver_version"] == "570.133.20"
