"""The runner reads plain messages, never the scheduler's `Request`: no module of jaxllm/runner imports
jaxllm.request (nor jaxllm.core: core and runner meet only in the engine), directly or through what it
imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "jaxllm" / "runner"
FORBIDDEN = ("jaxllm.request", "jaxllm.core")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_runner_source_does_not_import_request_or_core():
    files = sorted(RUNNER.glob("*.py"))
    assert len(files) >= 8
    bad = {
        f.name: sorted(n for n in _imported_modules(f) if n.startswith(FORBIDDEN) or n == "jaxllm.request")
        for f in files
    }
    assert not {k: v for k, v in bad.items() if v}


def test_importing_the_runner_loads_no_request():
    mods = ", ".join(f"jaxllm.runner.{f.stem}" for f in sorted(RUNNER.glob("*.py")) if f.stem != "__init__")
    code = f"import sys, {mods}; print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r})))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout
