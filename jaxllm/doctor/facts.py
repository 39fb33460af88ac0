"""What `jaxllm doctor` looks at, gathered once into plain data that the checks (checks.py) read.

    gather_facts() -> EnvironmentFacts
      versions       importlib.metadata: jax, jaxlib, the CUDA plugins and their PJRT packages, nvidia-* wheels
      NVIDIA GPU     /proc/driver/nvidia/version (the driver), nvidia-smi (names, memory): whatever JAX makes of it
      JAX's view     jax.devices() after its backends start (their errors and warnings kept), memory_stats()
      libraries      /proc/self/maps once the backend has started: the cuDNN / cuBLAS / NCCL / cudart files loaded;
                     the pip wheels' copies (site-packages/nvidia/*/lib) and those in LD_LIBRARY_PATH's folders
      compile cache  the folder the engine would use (--compilation-cache-dir's rule), its size, writable or not
Each probe is a function of what it reads (a file's text, a folder list), so that tests can feed it made-up
input; the checks take an EnvironmentFacts, which tests build by hand for environments this machine is not.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from jaxllm.compat import jax_backend_errors

# The NVIDIA libraries JAX's CUDA plugin loads (cuDNN's sub-libraries included), by file name.
NVIDIA_LIBRARY = re.compile(
    r"^lib(cudart|cublas|cublasLt|cudnn(_\w+)?|nccl|cupti|cusparse|cusolver|cufft|nvrtc|nvJitLink|nvshmem_host)"
    r"\.so(\.\d+)*$"
)
# Those the report names one by one (the rest are counted).
MAIN_LIBRARIES = {
    "libcudnn": "cuDNN",
    "libcublas": "cuBLAS",
    "libcublasLt": "cuBLASLt",
    "libnccl": "NCCL",
    "libcudart": "CUDA runtime",
}
CUDA_MAJORS = (12, 13)
PLUGIN_PACKAGES = tuple(f"jax-cuda{m}-{part}" for m in CUDA_MAJORS for part in ("plugin", "pjrt"))
PACKAGES = ("jax", "jaxlib", *PLUGIN_PACKAGES, "jaxllm")


@dataclass(frozen=True)
class LibraryFile:
    soname: str  # the name the dynamic loader looks up: libcublas.so.12
    path: str  # where it was found: a mapped file, a file in a wheel's or an LD_LIBRARY_PATH folder
    version: str | None = None  # from the file's name (libcudnn.so.9.1.0) or its pip wheel's version
    wheel: str | None = None  # the pip distribution it came with (nvidia-cudnn-cu12); None: not a pip wheel's

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path)

    @property
    def stem(self) -> str:  # libcublas
        return self.soname.split(".so", 1)[0]


@dataclass(frozen=True)
class NvidiaGpu:
    index: int
    name: str
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None


@dataclass(frozen=True)
class DeviceFacts:
    id: int
    platform: str  # JAX's: cpu, gpu
    kind: str  # "NVIDIA H100 80GB HBM3", "cpu"
    bytes_limit: int | None = None  # memory_stats(): what XLA's allocator may take on this device
    bytes_in_use: int | None = None


@dataclass(frozen=True)
class CacheFacts:
    path: str | None  # None: the cache is off (--compilation-cache-dir '')
    exists: bool = False
    files: int = 0
    bytes: int = 0
    writable: bool = True  # the folder, or the nearest existing folder above it, takes new files


@dataclass(frozen=True)
class EnvironmentFacts:
    python_version: str
    python_executable: str = ""
    packages: dict[str, str] = field(default_factory=dict)  # PACKAGES installed -> version
    nvidia_wheels: dict[str, str] = field(default_factory=dict)  # every nvidia-* distribution -> version
    gpu_evidence: tuple[str, ...] = ()  # what shows an NVIDIA GPU: the driver's /proc file, nvidia-smi
    driver_version: str | None = None
    gpus: tuple[NvidiaGpu, ...] = ()  # nvidia-smi's list
    jax_platforms: str | None = None  # $JAX_PLATFORMS
    jax_error: str | None = None  # JAX could not start any backend
    backend: str | None = None  # jax.default_backend()
    backend_errors: dict[str, str] = field(default_factory=dict)  # platform -> why its backend did not start
    jax_warnings: tuple[str, ...] = ()  # what JAX and its plugins warned while starting
    devices: tuple[DeviceFacts, ...] = ()
    loaded_libraries: tuple[LibraryFile, ...] = ()  # NVIDIA libraries in this process, from /proc/self/maps
    wheel_libraries: tuple[LibraryFile, ...] = ()  # the pip wheels' copies (site-packages/nvidia/*/lib)
    ld_library_path: tuple[str, ...] = ()
    ld_library_path_libraries: tuple[LibraryFile, ...] = ()  # NVIDIA libraries in LD_LIBRARY_PATH's folders
    ld_preload: str | None = None
    compilation_cache: CacheFacts = CacheFacts(None)

    @property
    def gpu_present(self) -> bool:
        return bool(self.gpu_evidence)

    def cuda_plugins(self) -> list[int]:
        """The CUDA majors whose JAX plugin is installed."""
        return [m for m in CUDA_MAJORS if f"jax-cuda{m}-plugin" in self.packages]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- probes: each a function of what it reads ----------------------------------------------------------
def soname_of(file_name: str) -> str:
    """libcudnn.so.9.1.0 -> libcudnn.so.9 (what a library is looked up by); libcublas.so.12 unchanged."""
    m = re.match(r"^(lib[\w-]+\.so\.\d+)", file_name)
    return m.group(1) if m else file_name


def version_in_name(file_name: str) -> str | None:
    """libcudnn.so.9.1.0 -> 9.1.0; a bare soname (libcudnn.so.9) says only its major: None."""
    m = re.match(r"^lib[\w-]+\.so\.(\d+\.\d+(?:\.\d+)*)$", file_name)
    return m.group(1) if m else None


def parse_maps(text: str) -> list[str]:
    """The NVIDIA library files mapped into a process, in order, once each, from /proc/<pid>/maps."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].removesuffix(" (deleted)")
        if path.startswith("/") and NVIDIA_LIBRARY.match(os.path.basename(path)):
            seen.setdefault(path, None)
    return list(seen)


def parse_driver_version(text: str) -> str | None:
    """The driver's version from /proc/driver/nvidia/version ("... Kernel Module  580.95.05  ...", the open
    modules' "... Open Kernel Module for x86_64  580.95.05 ...")."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def parse_nvidia_smi(text: str) -> tuple[str | None, list[NvidiaGpu]]:
    """(driver version, GPUs) from `nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used
    --format=csv,noheader,nounits`."""
    driver, gpus = None, []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 5 or not cols[0].isdigit():
            continue
        driver = driver or cols[2] or None
        total, used = (int(c) if c.isdigit() else None for c in cols[3:])
        gpus.append(NvidiaGpu(int(cols[0]), cols[1], total, used))
    return driver, gpus


def nvidia_library_files(folder: str) -> list[str]:
    """The NVIDIA library file names in a folder (none when it does not exist)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if NVIDIA_LIBRARY.match(n))


def wheel_library_folders(search_path: list[str]) -> list[Path]:
    """site-packages/nvidia/<component>/lib for every entry of sys.path: where pip's nvidia-* wheels put the
    libraries (nvidia/cudnn/lib for CUDA 12 and 13 alike, nvidia/cublas/lib for 12, nvidia/cu13/lib for 13)."""
    folders = []
    for entry in search_path:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            folders.extend(sorted(p for p in root.glob("*/lib") if p.is_dir()))
    return folders


def _wheel_owners() -> dict[str, tuple[str, str]]:
    """Real path of each library file the installed nvidia-* distributions list -> (name, version)."""
    owners = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not name.startswith("nvidia-"):
            continue
        for f in dist.files or ():
            if ".so" in f.name and NVIDIA_LIBRARY.match(f.name):
                owners[os.path.realpath(dist.locate_file(f))] = (name, dist.version)
    return owners


def describe_library(path: str, owners: dict[str, tuple[str, str]], wheel_folders: list[Path]) -> LibraryFile:
    real = os.path.realpath(path)
    owner = owners.get(real)
    in_wheel = owner is not None or any(Path(real).is_relative_to(f.resolve()) for f in wheel_folders)
    version = version_in_name(os.path.basename(real)) or (owner[1] if owner else None)
    wheel = owner[0] if owner else (str(Path(real).parent.parent.name) if in_wheel else None)
    if wheel is not None and owner is None:
        wheel = f"nvidia/{wheel}"  # a wheel's folder whose distribution metadata names no such file
    return LibraryFile(soname_of(os.path.basename(path)), path, version, wheel)


def installed_versions() -> tuple[dict[str, str], dict[str, str]]:
    packages, wheels = {}, {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in PACKAGES:
            packages[name] = dist.version
        elif name.startswith("nvidia-"):
            wheels[name] = dist.version
    return packages, dict(sorted(wheels.items()))


def find_nvidia_gpu(timeout_s: float = 15.0) -> tuple[tuple[str, ...], str | None, list[NvidiaGpu]]:
    """(evidence, driver version, GPUs): the kernel driver's /proc file, and nvidia-smi when it lists GPUs
    (an nvidia-smi that cannot reach a driver, as in a container started without GPUs, is no evidence)."""
    evidence, driver, gpus = [], None, []
    proc = Path("/proc/driver/nvidia/version")
    if proc.exists():
        evidence.append(str(proc))
        driver = parse_driver_version(proc.read_text(errors="replace"))
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "--query-gpu=index,name,driver_version,memory.total,memory.used"
        try:
            out = subprocess.run(
                [smi, query, "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=timeout_s, check=False,
            )  # fmt: skip
            smi_driver, gpus = parse_nvidia_smi(out.stdout) if out.returncode == 0 else (None, [])
        except (OSError, subprocess.TimeoutExpired):
            smi_driver, gpus = None, []
        if gpus:
            evidence.append(smi)
            driver = driver or smi_driver
    return tuple(evidence), driver, gpus


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def jax_view() -> dict:
    """Starts JAX's backends (as the engine would) and reports what it got: the default backend, devices and
    their memory, the backends that failed and what JAX and its plugins warned meanwhile."""
    handler = _Collect()
    loggers = [logging.getLogger(n) for n in ("jax", "jax_plugins")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        import jax

        devices = jax.devices()
        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - a broken installation is what the doctor reports
        return {"jax_error": f"{type(e).__name__}: {e}", "jax_warnings": tuple(handler.messages)}
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    try:
        errors = jax_backend_errors()
    except ImportError:  # JAX moved its record of the backends that failed quietly
        errors = {}
    facts = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - not every backend keeps them
            stats = {}
        facts.append(
            DeviceFacts(d.id, d.platform, d.device_kind, stats.get("bytes_limit"), stats.get("bytes_in_use"))
        )
    return {
        "backend": backend,
        "devices": tuple(facts),
        "backend_errors": {k: v for k, v in errors.items() if k != "tpu" or backend == "tpu"},
        "jax_warnings": tuple(handler.messages),
    }


def compilation_cache_facts(path: str | None) -> CacheFacts:
    if path is None:
        return CacheFacts(None)
    folder = Path(path).expanduser()
    files = size = 0
    if folder.is_dir():
        for root, _, names in os.walk(folder):
            for n in names:
                try:
                    size += os.stat(os.path.join(root, n)).st_size
                    files += 1
                except OSError:
                    pass
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    writable = os.access(probe, os.W_OK | os.X_OK)
    return CacheFacts(str(folder), folder.is_dir(), files, size, writable)


def gather_facts(
    compilation_cache_dir: str | None,
    *,
    environ: dict[str, str] | None = None,
    maps_path: str = "/proc/self/maps",
) -> EnvironmentFacts:
    """Everything the checks read. Starts JAX's backends in this process first, so that the libraries
    they load are in /proc/self/maps."""
    env = os.environ if environ is None else environ
    packages, wheels = installed_versions()
    evidence, driver, gpus = find_nvidia_gpu()
    view = jax_view()
    try:
        maps = Path(maps_path).read_text()
    except OSError:  # not Linux
        maps = ""
    owners = _wheel_owners()
    wheel_folders = wheel_library_folders(sys.path)
    wheel_libs = [
        describe_library(str(folder / name), owners, wheel_folders)
        for folder in wheel_folders
        for name in nvidia_library_files(str(folder))
    ]
    ld_path = tuple(p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p)
    # A folder holds libcudnn.so.9 and the libcudnn.so.9.1.0 it links to: one library, listed once.
    ld_libs = {
        (lib.folder, lib.soname): lib
        for d in ld_path
        for n in nvidia_library_files(d)
        for lib in [describe_library(os.path.join(d, n), owners, wheel_folders)]
    }
    return EnvironmentFacts(
        python_version=sys.version.split()[0],
        python_executable=sys.executable,
        packages=packages,
        nvidia_wheels=wheels,
        gpu_evidence=evidence,
        driver_version=driver,
        gpus=tuple(gpus),
        jax_platforms=env.get("JAX_PLATFORMS") or None,
        loaded_libraries=tuple(describe_library(p, owners, wheel_folders) for p in parse_maps(maps)),
        wheel_libraries=tuple(wheel_libs),
        ld_library_path=ld_path,
        ld_library_path_libraries=tuple(ld_libs.values()),
        ld_preload=env.get("LD_PRELOAD") or None,
        compilation_cache=compilation_cache_facts(compilation_cache_dir),
        **view,
    )
