"""`jaxllm doctor [--json] [--compilation-cache-dir DIR]` and the server's one-line environment summary.

    gather_facts (facts.py) -> run_checks (checks.py) -> render_text | report_json | summary_line
The text report lists what was found, one subject a line, then one line per problem with its fix; the
exit status is 1 when any problem is an error. `--json` prints the same as one JSON object (facts, findings,
exit_status) for scripts and support tickets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxllm.doctor.checks import CHECKS, Finding, exit_status, run_checks
from jaxllm.doctor.facts import MAIN_LIBRARIES, PLUGIN_PACKAGES, EnvironmentFacts, LibraryFile, gather_facts

GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _library(lib: LibraryFile) -> str:
    origin = f"pip: {lib.wheel}" if lib.wheel else "not from a pip wheel"
    return f"{lib.version or '?'}  {lib.path}  ({origin})"


def _loaded(facts: EnvironmentFacts, stem: str) -> list[LibraryFile]:
    return [lib for lib in facts.loaded_libraries if lib.stem == stem]


def _plugins(facts: EnvironmentFacts) -> str:
    have = [f"{p} {facts.packages[p]}" for p in PLUGIN_PACKAGES if p in facts.packages]
    return ", ".join(have) if have else "none (JAX can use the CPU only)"


def _gpus(facts: EnvironmentFacts) -> str:
    if not facts.gpu_present:
        return "none found"
    names = sorted({g.name for g in facts.gpus}) or ["NVIDIA GPU"]
    count = f"{len(facts.gpus)} x " if facts.gpus else ""
    text = f"{count}{', '.join(names)}, driver {facts.driver_version or 'unknown'}"
    used = [g for g in facts.gpus if g.memory_total_mib is not None and g.memory_used_mib is not None]
    if used:
        text += "; in use: " + ", ".join(
            f"GPU {g.index} {g.memory_used_mib / 1024:.1f} of {g.memory_total_mib / 1024:.1f} GiB"
            for g in used
        )
    return text


def _devices(facts: EnvironmentFacts) -> str:
    if facts.jax_error is not None:
        return f"none: {facts.jax_error}"
    kinds = sorted({d.kind for d in facts.devices})
    text = f"{facts.backend}: {len(facts.devices)} device(s) ({', '.join(kinds)})"
    free = [
        d.bytes_limit - d.bytes_in_use for d in facts.devices if d.bytes_limit and d.bytes_in_use is not None
    ]
    if free:
        text += f"; free for XLA: {_gib(min(free))}" + (" per device (least)" if len(free) > 1 else "")
    return text


def _cache(facts: EnvironmentFacts) -> str:
    c = facts.compilation_cache
    if c.path is None:
        return "off (--compilation-cache-dir '')"
    if not c.exists:
        return f"{c.path} (not created yet)"
    return f"{c.path}: {c.files} files, {_gib(c.bytes)}" + ("" if c.writable else " (NOT WRITABLE)")


def _ld_library_path(facts: EnvironmentFacts) -> str:
    if not facts.ld_library_path:
        return "unset"
    parts = []
    for folder in facts.ld_library_path:
        names = sorted({lib.soname for lib in facts.ld_library_path_libraries if lib.folder == folder})
        parts.append(f"{folder} ({', '.join(names)})" if names else folder)
    return "; ".join(parts)


def render_text(facts: EnvironmentFacts, findings: list[Finding]) -> str:
    rows = [
        ("Python", f"{facts.python_version}  {facts.python_executable}"),
        ("jax, jaxlib", f"{facts.packages.get('jax', 'missing')}, {facts.packages.get('jaxlib', 'missing')}"),
        ("CUDA plugin", _plugins(facts)),
        ("NVIDIA GPU", _gpus(facts)),
        ("JAX devices", _devices(facts)),
    ]
    for stem, label in MAIN_LIBRARIES.items():
        loaded = _loaded(facts, stem)
        rows.extend((label if i == 0 else "", _library(lib)) for i, lib in enumerate(loaded))
        if not loaded:
            rows.append((label, "not loaded"))
    others = [lib for lib in facts.loaded_libraries if lib.stem not in MAIN_LIBRARIES]
    if others:
        folders = sorted({lib.folder for lib in others})
        rows.append(("other NVIDIA libs", f"{len(others)} loaded, from {', '.join(folders)}"))
    wheels = ", ".join(f"{k} {v}" for k, v in facts.nvidia_wheels.items())
    rows += [
        ("NVIDIA pip wheels", wheels or "none"),
        ("LD_LIBRARY_PATH", _ld_library_path(facts)),
        ("compile cache", _cache(facts)),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = ["jaxllm doctor", *(f"  {k.ljust(width)}{v}" for k, v in rows), ""]
    lines += [f.line() for f in findings]
    errors = sum(f.level == "error" for f in findings)
    if not findings:
        lines.append("No problems found.")
    else:
        lines.append(f"{errors} error(s), {len(findings) - errors} warning(s).")
    return "\n".join(lines)


def report_json(facts: EnvironmentFacts, findings: list[Finding]) -> dict:
    return {
        "exit_status": exit_status(findings),
        "findings": [dataclasses.asdict(f) for f in findings],
        "facts": facts.to_dict(),
    }


def summary_line(facts: EnvironmentFacts, findings: list[Finding]) -> str:
    """One line for the server's start-up log: versions, devices, driver, the main libraries and where they
    come from, the compilation cache, and how many problems `jaxllm doctor` would report."""
    libs = []
    for stem, label in MAIN_LIBRARIES.items():
        for lib in _loaded(facts, stem)[:1]:
            libs.append(f"{label} {lib.version or '?'} ({'pip' if lib.wheel else lib.folder})")
    plugins = [f"{p} {facts.packages[p]}" for p in PLUGIN_PACKAGES if p in facts.packages]
    parts = [
        f"Python {facts.python_version}, jax {facts.packages.get('jax')}, jaxlib {facts.packages.get('jaxlib')}, "
        f"CUDA plugin {', '.join(plugins) or 'none'}",
        f"JAX devices {_devices(facts)}",
        f"NVIDIA GPU {_gpus(facts)}",
        *(["libraries " + ", ".join(libs)] if libs else []),
        f"compile cache {_cache(facts)}",
    ]
    problems = (
        f"{len(findings)} problem(s), see below" if findings else "no problems found"
    ) + " (`jaxllm doctor` for details)"
    return "Environment: " + "; ".join(parts) + "; " + problems


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxllm doctor",
        description="Checks the environment jaxllm runs in: versions, devices, the NVIDIA driver and the "
        "CUDA libraries loaded, LD_LIBRARY_PATH, the compilation cache. Exits with status 1 when it finds "
        "an error, naming the fix.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (facts, findings, exit_status)")
    p.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="the folder `jaxllm serve --compilation-cache-dir` is given; default: $JAXLLM_CACHE_DIR or "
        "~/.cache/jaxllm/xla",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from jaxllm.engine_args import resolve_compilation_cache_dir

    args = make_parser().parse_args(argv)
    # Look at the GPU without taking its memory (a server may be running on it).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    facts = gather_facts(resolve_compilation_cache_dir(args.compilation_cache_dir))
    findings = run_checks(facts, CHECKS)
    if args.json:
        print(json.dumps(report_json(facts, findings), indent=2))
    else:
        print(render_text(facts, findings))
    sys.stdout.flush()
    return exit_status(findings)
