"""Every notebook in notebooks/ runs top to bottom, as a user runs it, and is kept in git without outputs.

Each notebook checks its own results with assert cells (against transformers, the plain-jnp kernel
reference, or the benchmark JSON it plots), so executing it is the test: a failing cell fails it. The
kernel is this interpreter (a kernelspec written for the run, so an installed "python3" spec pointing at
another Python cannot be picked), its working directory the repository root, matplotlib on Agg (no
display in CI). Outputs stay out of git: they would go stale and bloat diffs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ipykernel  # noqa: F401 - the notebooks' kernel; imported here so a missing one fails, not skips
import matplotlib  # noqa: F401 - the notebooks plot
import nbclient
import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # a cold start compiles the engine's step: a minute or two on a 2-core CPU
KERNEL_NAME = "jaxllm-test-python"


@pytest.fixture(scope="module")
def kernel_of_this_interpreter(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL_NAME, "language": "python"})
    )
    monkeypatch_module.setenv("JUPYTER_PATH", str(root))
    monkeypatch_module.setenv("MPLBACKEND", "Agg")
    monkeypatch_module.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    return KERNEL_NAME


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {
        "quickstart.ipynb",
        "kernel_experiments.ipynb",
        "serving_figures.ipynb",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_of_this_interpreter):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_of_this_interpreter,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first error
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count for c in ran)


def _tracked_notebooks() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "notebooks/*.ipynb"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): what is on disk
        return NOTEBOOKS
    return [REPO / p for p in out.decode().split("\0") if p]


def test_notebooks_in_git_are_stripped():
    tracked = _tracked_notebooks()
    assert tracked
    for path in tracked:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            assert cell.outputs == [], f"{path.name} cell {i} keeps its outputs: clear them before committing"
            assert cell.execution_count is None, (
                f"{path.name} cell {i} keeps execution_count {cell.execution_count}"
            )
