"""Every name jaxllm installs starts with `jaxllm`, and a user's own files never stand in for ours.

A folder that holds `server.py`, `engine.py`, `config.py`, ... is where many users start the server; Python
puts that folder first on sys.path, so a product module imported under a bare name like `server` would
load the user's file instead (once, that file started the server again, which imported it again: a fork
storm). Here the wheel built from this checkout must hold only `jaxllm*` names, and from a folder of files
that fail loudly when imported, `--help`, a real server start (health, one completion, stop) and the
offline `LLM(...)` must all work, and agree on what the model computes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
USERS_FILES = ("server", "engine", "config", "models", "utils", "pallas_kernels")
NOT_SOURCE = ("*.egg-info", "__pycache__", ".git", ".venv", "build", "dist", ".*_cache", ".whl", ".gguf")
PROMPT, MAX_TOKENS = [5, 6, 7, 8], 4  # token ids of the tiny-llama preset (vocab 512, no tokenizer)


def built_wheel(dest: Path) -> Path:
    """A wheel built from a copy of this checkout by the build backend its pyproject names (what pip
    runs with --no-build-isolation), so the build leaves nothing in the checkout."""
    src = dest / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    with open(src / "pyproject.toml", "rb") as f:
        backend = tomllib.load(f)["build-system"]["build-backend"]
    code = "import importlib, sys; print(importlib.import_module(sys.argv[1]).build_wheel(sys.argv[2]))"
    res = subprocess.run(
        [sys.executable, "-c", code, backend, str(dest / "wheel")],
        cwd=src, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return dest / "wheel" / res.stdout.strip().splitlines()[-1]


def installed_top_level_names(wheel: Path) -> set[str]:
    """What installing the wheel puts into site-packages: first path parts, and those under .data's
    purelib/platlib (which install there too)."""
    names = set()
    for entry in zipfile.ZipFile(wheel).namelist():
        parts = entry.split("/")
        if parts[0].endswith(".data") and len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            parts = parts[2:]
        names.add(parts[0].removesuffix(".py"))
    return names


def test_the_wheel_installs_only_jaxllm_names(tmp_path):
    wheel = built_wheel(tmp_path)
    names = installed_top_level_names(wheel)
    foreign = sorted(n for n in names if not n.startswith("jaxllm"))
    assert not foreign, f"{wheel.name} installs top-level names that do not start with jaxllm: {foreign}"
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
        entry_points = next((z.read(n).decode() for n in z.namelist() if n.endswith("entry_points.txt")), "")
    source = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "jaxllm").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert shipped == source, (sorted(source - shipped)[:10], sorted(shipped - source)[:10])
    targets = [line.split("=", 1)[1].strip() for line in entry_points.splitlines() if "=" in line]
    assert targets and all(t.startswith("jaxllm.") for t in targets), entry_points


@pytest.fixture(scope="module")
def users_folder(tmp_path_factory) -> Path:
    """A working folder holding files named like jaxllm's parts (and the old top-level names), each of
    which stops the interpreter if anything imports it."""
    folder = tmp_path_factory.mktemp("users_folder")
    own_names = {
        p.stem for p in (REPO / "jaxllm").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    for name in {*USERS_FILES, *own_names} - {"__init__"}:
        (folder / f"{name}.py").write_text(f'raise SystemExit("imported the user\'s file {name}.py")\n')
    return folder


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def run_in(folder: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, *args], cwd=folder, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    assert "imported the user's file" not in res.stdout + res.stderr, res.stdout + res.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_the_users_files_fail_when_imported(users_folder):
    """The decoys work: importing one from that folder stops the interpreter with its message."""
    res = subprocess.run(
        [sys.executable, "-c", "import server"],
        cwd=users_folder,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and "imported the user's file server.py" in res.stderr


def test_help_from_the_users_folder(users_folder):
    res = run_in(users_folder, ["-m", "jaxllm.entrypoints.openai.api_server", "--help"], timeout=120)
    for flag in ("--model", "--max-model-len", "--load-format", "--port"):
        assert flag in res.stdout


OFFLINE = """
import json
from jaxllm import LLM, SamplingParams

llm = LLM("tiny-llama", load_format="dummy", max_model_len=64)
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True, logprobs=0)
[out] = llm.generate([{{"prompt_token_ids": {prompt}}}], params, use_tqdm=False)
c = out.outputs[0]
print(json.dumps({{"token_ids": list(c.token_ids), "logprobs": [p[t].logprob for p, t in zip(c.logprobs, c.token_ids)]}}))
"""


@pytest.fixture(scope="module")
def offline_result(users_folder) -> dict:
    res = run_in(users_folder, ["-c", OFFLINE.format(prompt=PROMPT, max_tokens=MAX_TOKENS)], timeout=600)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_offline_llm_from_the_users_folder(offline_result):
    assert len(offline_result["token_ids"]) == MAX_TOKENS
    assert all(0 <= t < 512 for t in offline_result["token_ids"])
    assert all(lp <= 0 for lp in offline_result["logprobs"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_from_the_users_folder(users_folder, offline_result, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    args = ["--model", "tiny-llama", "--load-format", "dummy", "--max-model-len", "64"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxllm.entrypoints.openai.api_server", *args, "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=users_folder, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (
                f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
            )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no /health in 600 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.25)
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answer = r.json()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text()
    assert "imported the user's file" not in log, log[-3000:]
    assert proc.returncode in (0, -signal.SIGINT), (
        f"stopping the server: exit {proc.returncode}\n{log[-3000:]}"
    )
    assert answer["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": MAX_TOKENS,
                               "total_tokens": len(PROMPT) + MAX_TOKENS}  # fmt: skip
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    # The same preset, seed and greedy sampling: the server's tokens are the offline LLM's, so their
    # log-probabilities agree (to float32 rounding of differently batched steps).
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(offline_result["logprobs"], abs=1e-4)


def test_the_wheel_declares_its_license_as_an_spdx_expression(tmp_path):
    """The license is the SPDX string (core metadata's License-Expression), not the TOML table that
    setuptools stops building in February 2027."""
    wheel = built_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        fields = [line for line in z.read(meta).decode().splitlines() if line.startswith("License")]
    assert "License-Expression: Apache-2.0" in fields, fields
    assert not any(f.startswith("License: ") for f in fields), fields
