"""No arrow runs back up: the package boundaries of docs/architecture.md, checked on the source.

Every import under jaxllm/ and benchmarks/ (at module level, inside functions, under TYPE_CHECKING,
relative ones resolved, `importlib.import_module("...")` with a literal name) is checked against RULES,
which name packages, never today's files, so a module added later is held to them too. A failure lists
each offending import as `file:line -> module`. A child process then checks what static reading cannot:
importing the host-only modules (core, the shared types, the server) leaves jax out of sys.modules,
through every module they import in turn.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JAX_FAMILY = ("jax", "jaxlib", "flax", "orbax")  # flax and orbax import jax themselves
ENV_READS = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the scanned root, e.g. "jaxllm/core/scheduler.py"
    line: int
    importer: str  # the importing module, e.g. "jaxllm.core.scheduler"
    module: str  # the module named by the statement: `from a.b import c` -> "a.b"
    names: tuple[str, ...] = ()  # `from a.b import c, d` -> ("c", "d"); () for `import a.b`

    def targets(self) -> tuple[str, ...]:
        """What the statement may import: the module, and each name as a submodule of it."""
        return (self.module, *(f"{self.module}.{n}" for n in self.names if n != "*"))

    def __str__(self) -> str:
        shown = f"{self.module} ({', '.join(self.names)})" if self.names else self.module
        return f"{self.file}:{self.line} -> {shown}"


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    rel = path.relative_to(root)
    importer = module_name(rel)
    package = importer if rel.name == "__init__.py" else importer.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(str(rel), node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            yield Import(str(rel), node.lineno, importer, module, tuple(a.name for a in node.names))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(str(rel), node.lineno, importer, node.args[0].value)


def env_reads_of(path: Path, root: Path) -> Iterator[Import]:
    """`os.environ`, `os.getenv(...)` and `from os import environ`: reading the environment."""
    rel = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENV_READS and ast.unparse(node.value) == "os":
            yield Import(str(rel), node.lineno, module_name(rel), f"os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ENV_READS:
                    yield Import(str(rel), node.lineno, module_name(rel), "os", (alias.name,))


def python_files(root: Path, *folders: str) -> list[Path]:
    skip = {"__pycache__", ".venv", "build", "dist"}
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py") if not skip & set(p.parts))


# ---- the rules ----------------------------------------------------------------------------------------------
def in_folder(file: str, *folders: str) -> bool:
    return any(file.startswith(folder + "/") for folder in folders)


def is_host_only(file: str) -> bool:
    """jaxllm/core/, jaxllm/server/, jaxllm/structured_output/, and the shared plain-data types: the modules
    directly in jaxllm/ (requests, outputs, configuration, sampling parameters, stats, step outputs), all but
    compat.py."""
    if in_folder(file, "jaxllm/core", "jaxllm/server", "jaxllm/structured_output"):
        return True
    return Path(file).parent == Path("jaxllm") and file != "jaxllm/compat.py"


def kernel_may_import(module: str) -> bool:
    top = module.split(".")[0]
    if top in ("jax", "jaxlib", "numpy", "__future__") or in_package(module, "jaxllm.kernels"):
        return True
    return top in sys.stdlib_module_names


@dataclass(frozen=True)
class Rule:
    says: str
    applies_to: Callable[[str], bool]  # the importing file, relative to the repository root
    forbids: Callable[[str], bool]  # a module it imports


def any_of(*packages: str) -> Callable[[str], bool]:
    return lambda m: any(in_package(m, p) for p in packages)


def within(*folders: str) -> Callable[[str], bool]:
    return lambda file: in_folder(file, *folders)


RULES = [
    Rule(
        "jaxllm/core, structured_output, the shared types and the server never import jax (nor flax or orbax)",
        is_host_only,
        any_of(*JAX_FAMILY),
    ),
    Rule(
        "jaxllm/kernels imports only jax, numpy, the standard library and itself",
        within("jaxllm/kernels"),
        lambda m: not kernel_may_import(m),
    ),
    Rule(
        "models and layers never import parallel, runner, engine, core, the server or the loader",
        within("jaxllm/models", "jaxllm/layers"),
        any_of(
            "jaxllm.parallel",
            "jaxllm.runner",
            "jaxllm.engine",
            "jaxllm.core",
            "jaxllm.server",
            "jaxllm.loader",
        ),
    ),
    Rule(
        "models call kernels only through the layers (attention, linear)",
        within("jaxllm/models"),
        any_of("jaxllm.kernels"),
    ),
    Rule("jaxllm/core never imports the runner", within("jaxllm/core"), any_of("jaxllm.runner")),
    Rule("the runner never imports jaxllm.core", within("jaxllm/runner"), any_of("jaxllm.core")),
    Rule(
        "only the server and the entry points import jaxllm.server",
        lambda f: in_folder(f, "jaxllm") and not in_folder(f, "jaxllm/server", "jaxllm/entrypoints"),
        any_of("jaxllm.server"),
    ),
    Rule(
        "jaxllm.testing is for tests and benchmarks, never the product",
        lambda f: in_folder(f, "jaxllm") and not in_folder(f, "jaxllm/testing"),
        any_of("jaxllm.testing"),
    ),
    Rule("the product never imports tests or benchmarks", within("jaxllm"), any_of("tests", "benchmarks")),
    Rule("benchmarks never import tests", within("benchmarks"), any_of("tests", "conftest")),
]


ENV_RULE = "jaxllm/kernels reads no environment variables"


@functools.cache
def scanned(root: Path) -> tuple[tuple[Import, ...], tuple[Import, ...]]:
    """(every import under jaxllm/ and benchmarks/, every environment read under jaxllm/kernels/)."""
    imports = tuple(i for p in python_files(root, "jaxllm", "benchmarks") for i in imports_of(p, root))
    reads = tuple(r for p in python_files(root, "jaxllm/kernels") for r in env_reads_of(p, root))
    return imports, reads


def violations(root: Path, rules: list[Rule]) -> dict[str, list[Import]]:
    imports, reads = scanned(root)
    found: dict[str, list[Import]] = {}
    for rule in rules:
        bad = [i for i in imports if rule.applies_to(i.file) and any(rule.forbids(t) for t in i.targets())]
        if bad:
            found[rule.says] = bad
    if reads:
        found[ENV_RULE] = list(reads)
    return found


def report(found: dict[str, list[Import]]) -> str:
    return "\n".join(f"{says}:\n" + "\n".join(f"  {imp}" for imp in imps) for says, imps in found.items())


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.says)
def test_no_import_crosses_a_boundary(rule):
    found = {k: v for k, v in violations(REPO, [rule]).items() if k == rule.says}
    if found:
        pytest.fail("imports that cross the package boundaries:\n" + report(found), pytrace=False)


def test_kernels_read_no_environment():
    found = {k: v for k, v in violations(REPO, []).items() if k == ENV_RULE}
    if found:
        pytest.fail(report(found), pytrace=False)


def test_the_rules_catch_each_kind_of_crossing(tmp_path):
    """The scanner on a planted tree: every forbidden import is reported at its line, wherever it sits
    (function body, TYPE_CHECKING, relative, import_module), and the allowed ones are not."""
    files = {
        "jaxllm/__init__.py": "",
        "jaxllm/core/__init__.py": "",
        "jaxllm/core/sched.py": """
            import numpy as np
            from jaxllm.config import EngineConfig

            def step():
                import jax.numpy as jnp
                from jaxllm.runner import model_runner
            """,
        "jaxllm/kernels/__init__.py": "",
        "jaxllm/kernels/op.py": """
            import functools
            import os
            import jax
            from . import helper
            from ..engine import llm_engine
            from jaxllm.parallel.mesh import TP_AXIS
            BLOCK = int(os.environ.get("BLOCK", "8"))
            """,
        "jaxllm/layers/attn.py": """
            from typing import TYPE_CHECKING
            from jaxllm.kernels import op
            if TYPE_CHECKING:
                from jaxllm.parallel import mesh
            """,
        "jaxllm/models/llama.py": "from jaxllm.kernels.op import BLOCK\n",
        "jaxllm/engine/eng.py": """
            import importlib
            from jaxllm import server
            srv = importlib.import_module("jaxllm.server.app")
            """,
        "jaxllm/entrypoints/cli.py": "from jaxllm.server.cli import main\n",
        "benchmarks/bench.py": "from tests.kernels.cases import make_problem\nfrom jaxllm.testing import cases\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    found = {says: sorted(str(i) for i in imps) for says, imps in violations(tmp_path, RULES).items()}
    assert found == {
        RULES[0].says: ["jaxllm/core/sched.py:6 -> jax.numpy"],
        RULES[1].says: [
            "jaxllm/kernels/op.py:6 -> jaxllm.engine (llm_engine)",
            "jaxllm/kernels/op.py:7 -> jaxllm.parallel.mesh (TP_AXIS)",
        ],
        RULES[2].says: ["jaxllm/layers/attn.py:5 -> jaxllm.parallel (mesh)"],
        RULES[3].says: ["jaxllm/models/llama.py:1 -> jaxllm.kernels.op (BLOCK)"],
        RULES[4].says: ["jaxllm/core/sched.py:7 -> jaxllm.runner (model_runner)"],
        RULES[6].says: [
            "jaxllm/engine/eng.py:3 -> jaxllm (server)",
            "jaxllm/engine/eng.py:4 -> jaxllm.server.app",
        ],
        RULES[9].says: ["benchmarks/bench.py:1 -> tests.kernels.cases (make_problem)"],
        ENV_RULE: ["jaxllm/kernels/op.py:8 -> os.environ"],
    }


# ---- at run time --------------------------------------------------------------------------------------------
WATCH_JAX = """
import importlib, json, sys, traceback
REPO, MODULES, FAMILY = sys.argv[1], json.loads(sys.argv[2]), tuple(json.loads(sys.argv[3]))
first = {}  # the first import of the jax family: the module named, and the jaxllm frames that asked for it

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in FAMILY and not first:
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(REPO + "/jaxllm/")]
            first.update(module=name, chain=[f"{f.filename[len(REPO) + 1:]}:{f.lineno}" for f in frames])
        return None

sys.meta_path.insert(0, Watch())
for m in MODULES:
    importlib.import_module(m)
    if first and "importing" not in first:
        first["importing"] = m
print(json.dumps({"first": first, "loaded": sorted(m for m in FAMILY if m in sys.modules)}))
"""


def host_only_modules() -> list[str]:
    files = [p.relative_to(REPO) for p in python_files(REPO, "jaxllm")]
    return [module_name(f) for f in files if is_host_only(f.as_posix())] + [
        "jaxllm.entrypoints.openai.api_server"
    ]


def test_importing_core_the_types_and_the_server_leaves_jax_out():
    mods = host_only_modules()
    assert {"jaxllm.core.scheduler", "jaxllm.server.app", "jaxllm.server.cli", "jaxllm.config"} <= set(mods)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", WATCH_JAX, str(REPO), json.dumps(mods), json.dumps(JAX_FAMILY)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    first = out["first"]
    if out["loaded"]:
        pytest.fail(
            f"importing {first.get('importing')} pulls in {first.get('module')} (loaded: {out['loaded']}); "
            "through " + " -> ".join(first.get("chain", [])),
            pytrace=False,
        )
