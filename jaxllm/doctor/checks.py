"""The doctor's checks: small pure functions of an EnvironmentFacts, each returning the problems it finds.

    run_checks(facts) -> [Finding(level "error" | "warning", message, fix)]
An error makes `jaxllm doctor` exit non-zero; every finding names its fix (a command or a variable to
change), because the reader is someone whose server did not start or runs on the wrong device.
The failures covered are the ones GPU deployments hit: JAX quietly on the CPU beside an NVIDIA GPU (no
CUDA plugin, a plugin for a newer CUDA than the driver, a plugin of another JAX version), and CUDA
libraries from LD_LIBRARY_PATH or the system loaded instead of the pip wheels' (a cuDNN or cuBLAS version
mix fails at start-up or at the first matmul).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxllm.doctor.facts import CUDA_MAJORS, EnvironmentFacts

# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA toolkit release notes, minor version
# compatibility): CUDA 12.x from 525.60.13, CUDA 13.x from 580.65.06.
MIN_DRIVER_MAJOR = {12: 525, 13: 580}


@dataclass(frozen=True)
class Finding:
    level: str  # "error": jaxllm will not run right (non-zero exit); "warning": it runs, but not as meant
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.level.upper()}: {self.message}. Fix: {self.fix}"


def driver_major(facts: EnvironmentFacts) -> int | None:
    v = facts.driver_version
    return int(v.split(".")[0]) if v and v.split(".")[0].isdigit() else None


def cuda_extra(facts: EnvironmentFacts) -> str:
    """The jaxllm extra that fits the driver: CUDA 13 from driver 580 on, else CUDA 12."""
    major = driver_major(facts)
    return "cuda13" if major is not None and major >= MIN_DRIVER_MAJOR[13] else "cuda12"


def _gpu_description(facts: EnvironmentFacts) -> str:
    names = sorted({g.name for g in facts.gpus})
    what = f"{len(facts.gpus)} x {', '.join(names)}" if names else "an NVIDIA GPU"
    driver = f", driver {facts.driver_version}" if facts.driver_version else ""
    return f"{what} ({'; '.join(facts.gpu_evidence)}{driver})"


def check_jax_installation(facts: EnvironmentFacts) -> list[Finding]:
    found = []
    jax_v, jaxlib_v = facts.packages.get("jax"), facts.packages.get("jaxlib")
    if jax_v is None or jaxlib_v is None:
        found.append(Finding("error", "jax or jaxlib is not installed", "pip install jaxllm"))
    elif jax_v != jaxlib_v:
        found.append(
            Finding(
                "error",
                f"jax {jax_v} and jaxlib {jaxlib_v} differ",
                f"pip install jax=={jax_v} jaxlib=={jax_v}",
            )
        )
    if facts.jax_error is not None:
        found.append(
            Finding(
                "error",
                f"JAX could not start a backend: {facts.jax_error}",
                "unset JAX_PLATFORMS to let JAX choose"
                if facts.jax_platforms
                else "reinstall JAX: pip install --force-reinstall jaxllm",
            )
        )
    return found


def check_cuda_plugins(facts: EnvironmentFacts) -> list[Finding]:
    """Each installed CUDA plugin and its PJRT package must be jax's own version; one CUDA major at a time."""
    found = []
    jax_v = facts.packages.get("jax")
    for major in CUDA_MAJORS:
        parts = {p: facts.packages.get(f"jax-cuda{major}-{p}") for p in ("plugin", "pjrt")}
        if not any(parts.values()):
            continue
        wrong = {p: v for p, v in parts.items() if v != jax_v}
        if wrong:
            have = ", ".join(f"jax-cuda{major}-{p} {v or 'missing'}" for p, v in parts.items())
            found.append(
                Finding(
                    "error",
                    f"the CUDA {major} plugin does not match jax {jax_v}: {have}",
                    f"pip install 'jax[cuda{major}]=={jax_v}'",
                )
            )
    if len(facts.cuda_plugins()) > 1:
        other = 12 if cuda_extra(facts) == "cuda13" else 13
        found.append(
            Finding(
                "warning",
                "JAX plugins for CUDA 12 and CUDA 13 are both installed; JAX loads one of them",
                f"keep the one for your driver: pip uninstall -y jax-cuda{other}-plugin jax-cuda{other}-pjrt",
            )
        )
    return found


def check_gpu_in_use(facts: EnvironmentFacts) -> list[Finding]:
    """An NVIDIA GPU is here but JAX runs on the CPU: jaxllm would serve at a hundredth of the speed."""
    if not facts.gpu_present or facts.backend in ("gpu", "cuda") or facts.jax_error is not None:
        return []
    gpu = _gpu_description(facts)
    platforms = [p.strip() for p in (facts.jax_platforms or "").split(",") if p.strip()]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return [
            Finding(
                "warning",
                f"JAX_PLATFORMS={facts.jax_platforms} keeps JAX on the {facts.backend or 'CPU'} although "
                f"{gpu} is present",
                "unset JAX_PLATFORMS",
            )
        ]
    plugins = facts.cuda_plugins()
    if not plugins:
        major = driver_major(facts)
        fix = f"pip install 'jaxllm[{cuda_extra(facts)}]'"
        if major is not None and major < MIN_DRIVER_MAJOR[12]:
            fix = f"update the NVIDIA driver to {MIN_DRIVER_MAJOR[12]} or newer, then {fix}"
        return [
            Finding(
                "error",
                f"JAX FELL BACK TO THE CPU: {gpu} is present but no CUDA plugin for JAX is installed",
                fix,
            )
        ]
    why = facts.backend_errors.get("cuda") or "; ".join(
        w for w in facts.jax_warnings if "CUDA" in w or "cuda" in w
    )
    why = why or "JAX gave no reason"
    major, plugin = driver_major(facts), max(plugins)
    if major is not None and major < MIN_DRIVER_MAJOR[plugin]:
        fix = (
            f"the driver {facts.driver_version} is older than CUDA {plugin} needs ({MIN_DRIVER_MAJOR[plugin]}+): "
            f"update the driver, or use CUDA 12: pip uninstall -y jax-cuda{plugin}-plugin jax-cuda{plugin}-pjrt "
            f"&& pip install 'jaxllm[cuda12]'"
        )
    else:
        fix = (
            "fix the library problems listed here if any; else rerun with TF_CPP_MIN_LOG_LEVEL=0 for XLA's "
            f"own log, and reinstall the plugin: pip install --force-reinstall 'jaxllm[cuda{plugin}]'"
        )
    return [
        Finding(
            "error",
            f"JAX FELL BACK TO THE CPU: {gpu} is present and jax-cuda{plugin}-plugin is installed, but the "
            f"CUDA backend did not start: {why}",
            fix,
        )
    ]


def _wheel_sonames(facts: EnvironmentFacts) -> dict[str, str]:
    """soname -> the pip wheel providing it."""
    return {lib.soname: lib.wheel or "a pip wheel" for lib in facts.wheel_libraries}


def check_ld_library_path(facts: EnvironmentFacts) -> list[Finding]:
    """An LD_LIBRARY_PATH folder holding a library a pip wheel also ships: the loader searches that folder
    before the wheel's own, so a library the plugin or cuDNN loads by name can come from it."""
    wheel = _wheel_sonames(facts)
    shadowing: dict[str, list[str]] = {}
    for lib in facts.ld_library_path_libraries:
        if lib.wheel is None and lib.soname in wheel:
            shadowing.setdefault(lib.folder, []).append(lib.soname)
    found = []
    for folder, names in shadowing.items():
        rest = [p for p in facts.ld_library_path if p != folder]
        fix = (
            f"remove {folder} from LD_LIBRARY_PATH: export LD_LIBRARY_PATH={':'.join(rest)}"
            if rest
            else f"unset LD_LIBRARY_PATH (its only entry is {folder})"
        )
        wheels = sorted({wheel[n] for n in names})
        found.append(
            Finding(
                "error",
                f"LD_LIBRARY_PATH entry {folder} holds {', '.join(sorted(set(names)))}, which shadow the "
                f"pip-installed NVIDIA libraries ({', '.join(wheels)}): a cuDNN/cuBLAS version mix fails at "
                "start-up or in the first matmul",
                fix,
            )
        )
    return found


def check_loaded_libraries(facts: EnvironmentFacts) -> list[Finding]:
    """What the running backend actually loaded: a library a pip wheel ships, loaded from elsewhere; the same
    library loaded from two files."""
    wheel = _wheel_sonames(facts)
    found = []
    by_name: dict[str, list[str]] = {}
    for lib in facts.loaded_libraries:
        by_name.setdefault(lib.soname, []).append(lib.path)
        if lib.wheel is not None or lib.soname not in wheel:
            continue
        if lib.folder in facts.ld_library_path:
            fix = f"remove {lib.folder} from LD_LIBRARY_PATH"
        elif facts.ld_preload:
            fix = f"unset LD_PRELOAD (it is {facts.ld_preload})"
        else:
            fix = (
                f"the system's copy in {lib.folder} came first: start jaxllm with LD_LIBRARY_PATH unset, or "
                "remove that copy from the loader's path (ldconfig)"
            )
        found.append(
            Finding(
                "error",
                f"{lib.soname} is loaded from {lib.path}, not from the pip wheel {wheel[lib.soname]} that JAX's "
                "CUDA plugin was built against",
                fix,
            )
        )
    for name, paths in by_name.items():
        if len(paths) > 1:
            found.append(
                Finding(
                    "error",
                    f"{name} is loaded twice, from {' and '.join(paths)}",
                    "keep one copy on the loader's path: unset LD_LIBRARY_PATH and LD_PRELOAD",
                )
            )
    return found


def check_compilation_cache(facts: EnvironmentFacts) -> list[Finding]:
    cache = facts.compilation_cache
    if cache.path is None or cache.writable:
        return []
    return [
        Finding(
            "error",
            f"the compilation cache {cache.path} is not writable: every start compiles everything again",
            f"make it writable (chown -R $(id -u) {cache.path}) or point --compilation-cache-dir / "
            "JAXLLM_CACHE_DIR at a writable folder",
        )
    ]


def check_gpu_memory(facts: EnvironmentFacts) -> list[Finding]:
    """Before jaxllm starts: a GPU already half full belongs to someone else, and the KV cache shrinks."""
    found = []
    for g in facts.gpus:
        if (
            g.memory_total_mib
            and g.memory_used_mib is not None
            and g.memory_used_mib > g.memory_total_mib / 2
        ):
            found.append(
                Finding(
                    "warning",
                    f"GPU {g.index} ({g.name}) already has {g.memory_used_mib / 1024:.1f} of "
                    f"{g.memory_total_mib / 1024:.1f} GiB in use by other processes",
                    "stop them (nvidia-smi lists them) or lower --gpu-memory-utilization to what is free",
                )
            )
    return found


# The checks in the order they are reported; the server's start-up line leaves out the memory check
# (by then the memory in use is its own).
CHECKS: tuple[Callable[[EnvironmentFacts], list[Finding]], ...] = (
    check_jax_installation,
    check_cuda_plugins,
    check_gpu_in_use,
    check_ld_library_path,
    check_loaded_libraries,
    check_compilation_cache,
    check_gpu_memory,
)
SERVER_START_CHECKS = tuple(c for c in CHECKS if c is not check_gpu_memory)


def run_checks(facts: EnvironmentFacts, checks=CHECKS) -> list[Finding]:
    return [f for check in checks for f in check(facts)]


def exit_status(findings: list[Finding]) -> int:
    return 1 if any(f.level == "error" for f in findings) else 0
