"""The Dockerfile, proven with a real Docker daemon, as CI runs it (no image registry reachable; Debian's
mirror and PyPI are):

    dockerd (Debian's docker.io, own data root and socket in a temp dir)
    debootstrap --variant=minbase trixie | docker import   -> a local base image (Python 3.13)
    docker build --build-arg BASE_IMAGE=<it> --build-arg JAXLLM_EXTRAS= --secret id=extra-ca-certs,src=<host CA bundle>
    docker run -p 127.0.0.1::8000 <image> --max-model-len 512   -> /health, /v1/models, a chat completion

The GPU image differs only in its build arguments (BASE_IMAGE nvidia/cuda, JAXLLM_EXTRAS cuda12).
Debian's bookworm has Python 3.11 and jax 0.11 needs 3.12, hence trixie. Everything the module creates
(daemon, images, container, volume) is removed at the end. Each phase prints its cost (`pytest -s`):
CI's time budget is tight.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.deploy.real_services import need

ROOT = Path(__file__).resolve().parents[2]
SUITE = os.environ.get("JAXLLM_DOCKER_TEST_SUITE", "trixie")  # a Debian suite with Python >= 3.12
MIRROR = os.environ.get("JAXLLM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE_VOLUME_PATH = "/home/jaxllm/.cache/jaxllm"  # the Dockerfile's VOLUME for JAX's compilation cache
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


def _took(what: str, start: float) -> None:
    """What each phase cost (CI's budget is tight): shown with -s, and in the report of a failure."""
    print(f"[docker test] {what}: {time.monotonic() - start:.0f} s", flush=True)


def _need_root() -> None:
    if os.geteuid() != 0:
        message = "dockerd and debootstrap need root (CI runs scripts/test.sh as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _host_ca_bundle() -> str:
    """The PEM bundle the host trusts: passed to the build so that it works behind a TLS-inspecting proxy."""
    for path in (os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile):
        if path and os.path.isfile(path):
            return path
    return "/etc/ssl/certs/ca-certificates.crt"


def _pem_certificates(text: str) -> set[str]:
    out, lines = set(), None
    for line in text.replace("\r", "").splitlines():
        if line.startswith("-----BEGIN CERTIFICATE-----"):
            lines = []
        elif line.startswith("-----END CERTIFICATE-----") and lines is not None:
            out.add("".join(lines))
            lines = None
        elif lines is not None:
            lines.append(line.strip())
    return out


class Docker:
    """The docker client bound to one daemon (its socket)."""

    def __init__(self, client: str, host: str, own: bool):
        self.client, self.host = client, host
        self.own = own  # started here: its whole data root goes at the end
        self.env = {**os.environ, "DOCKER_HOST": host, "DOCKER_BUILDKIT": "1"}

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, **kw
    ) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [self.client, *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}"
            )
        return r

    def answers(self) -> bool:
        try:
            return self("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@pytest.fixture(scope="module")
def docker():
    """A running Docker daemon: one that already answers on the default socket (never two daemons on one
    docker0 bridge), else dockerd started here with its data root, exec root, pidfile and socket in a
    temp dir, stopped and removed at the end."""
    dockerd = need("dockerd", "docker.io")
    need("debootstrap", "debootstrap")
    _need_root()
    # The client of Debian's package (/usr/bin/docker): a newer CLI without the buildx plugin refuses
    # BuildKit builds, and the Dockerfile needs BuildKit.
    candidates = [os.path.join(os.path.dirname(dockerd), "docker"), "/usr/bin/docker", shutil.which("docker")]
    client = next((c for c in candidates if c and os.access(c, os.X_OK)), None) or need("docker", "docker.io")
    existing = Docker(client, os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"), own=False)
    if existing.answers():
        yield existing
        return
    tmp = tempfile.mkdtemp(prefix="jaxllm-dockerd-", dir="/tmp")  # short: socket paths stop at 108 bytes
    sock = f"unix://{tmp}/docker.sock"
    log = open(os.path.join(tmp, "dockerd.log"), "w")
    args = [dockerd, "--data-root", f"{tmp}/data", "--exec-root", f"{tmp}/exec", "--pidfile", f"{tmp}/docker.pid", "-H", sock]  # fmt: skip
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    daemon = Docker(client, sock, own=True)
    start = time.monotonic()
    try:
        deadline = time.monotonic() + 90
        while not daemon.answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = Path(tmp, "dockerd.log").read_text()[-4000:]
                pytest.fail(f"dockerd did not start (exit status {proc.poll()}):\n{tail}")
            time.sleep(0.5)
        _took("dockerd start", start)
        yield daemon
    finally:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        _took("dockerd stop", start)
        shutil.rmtree(tmp, ignore_errors=True)
        _took("dockerd stop and its data root removed", start)


@pytest.fixture(scope="module")
def image(docker):
    """The Dockerfile built for the CPU on a Debian base made here, with the host's CA bundle as the
    extra-ca-certs secret. Yields (image name, CA bundle path)."""
    tag = uuid.uuid4().hex[:10]
    base, name = f"jaxllm-test-base:{SUITE}-{tag}", f"jaxllm-test:cpu-{tag}"
    ca_bundle = _host_ca_bundle()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jaxllm-debootstrap-", dir="/tmp") as tmp:
        rootfs = os.path.join(tmp, "rootfs")
        r = subprocess.run(
            ["debootstrap", "--variant=minbase", SUITE, rootfs, MIRROR],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert r.returncode == 0, f"debootstrap {SUITE} failed:\n{(r.stdout + r.stderr)[-4000:]}"
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        docker("import", "-", base, stdin=tar.stdout, timeout=300)
        assert tar.wait() == 0
    _took(f"debootstrap {SUITE} and docker import", start)
    start = time.monotonic()
    try:
        docker(
            "build", "--progress=plain", "-t", name, "-f", str(ROOT / "Dockerfile"),
            "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "JAXLLM_EXTRAS=",
            "--secret", f"id=extra-ca-certs,src={ca_bundle}",
            str(ROOT), timeout=1500,
        )  # fmt: skip
        _took("docker build", start)
        yield name, ca_bundle
    finally:
        if not docker.own:
            docker("rmi", "-f", name, base, check=False)


@pytest.fixture(scope="module")
def server(docker, image):
    """The image serving the embedded model on the CPU, its port 8000 published on a free port of
    127.0.0.1, its compilation cache on a named volume. Yields (container id, base URL, volume)."""
    name = image[0]
    volume = f"jaxllm-test-cache-{uuid.uuid4().hex[:10]}"
    cid = docker(
        "run", "-d", "-p", "127.0.0.1::8000", "-v", f"{volume}:{CACHE_VOLUME_PATH}",
        name, "--max-model-len", "512",
    ).stdout.strip()  # fmt: skip
    start = time.monotonic()
    try:
        port = docker("port", cid, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            state = docker("inspect", "-f", "{{.State.Running}}", cid).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                logs = docker("logs", cid, check=False)
                pytest.fail(f"the container did not become healthy:\n{(logs.stdout + logs.stderr)[-4000:]}")
            time.sleep(1)
        _took("container start until /health answers", start)
        yield cid, url, volume
    finally:
        start = time.monotonic()
        docker("rm", "-f", "-v", cid, check=False)
        docker("volume", "rm", "-f", volume, check=False)
        _took("container and volume removed", start)


def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_the_container_answers_a_chat_completion_as_jaxllm_does_outside_it(server):
    _, url, _ = server
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        models = json.loads(resp.read())["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]  # no model argument: the embedded one
    assert models[0]["max_model_len"] == 512  # the flags after the image name reach `jaxllm serve`
    reply = _post_json(
        f"{url}/v1/chat/completions",
        {"model": models[0]["id"], "messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS},
    )

    from jaxllm import LLM, SamplingParams

    start = time.monotonic()
    llm = LLM(max_model_len=512)  # the reference: the same greedy request in this process
    ref = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    _took("the reference in this process", start)
    assert reply["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert "Paris" in ref.outputs[0].text
    assert reply["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert reply["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)


def test_the_server_runs_unprivileged_with_its_compilation_cache_on_the_volume(docker, server):
    cid, url, volume = server
    assert docker("exec", cid, "id", "-u").stdout.strip() != "0"
    mounts = json.loads(docker("inspect", "-f", "{{json .Mounts}}", cid).stdout)
    assert {"Name": volume, "Destination": CACHE_VOLUME_PATH} in [
        {"Name": m.get("Name"), "Destination": m["Destination"]} for m in mounts
    ]
    # The chat completion of the other test, or this one, compiled steps: JAX wrote them to the volume.
    _post_json(
        f"{url}/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2}
    )
    entries = docker(
        "exec", cid, "find", f"{CACHE_VOLUME_PATH}/xla", "-type", "f", "-name", "jit_*"
    ).stdout.split()
    assert entries, "no JAX compilation cache entry in the volume"


def test_the_extra_ca_certificates_are_trusted_in_the_image(docker, image):
    name, ca_bundle = image
    inside = docker("run", "--rm", "--entrypoint", "cat", name, "/etc/ssl/certs/ca-certificates.crt").stdout
    wanted = _pem_certificates(Path(ca_bundle).read_text())
    assert wanted and wanted <= _pem_certificates(inside)


def test_a_missing_model_given_as_with_vllm_image_fails_naming_it(docker, image):
    r = docker("run", "--rm", image[0], "--model", "/models/missing-folder", check=False, timeout=300)
    assert r.returncode != 0
    assert "/models/missing-folder" in r.stdout + r.stderr


def _requirements_module():
    spec = importlib.util.spec_from_file_location(
        "pyproject_requirements", ROOT / "docker/pyproject_requirements.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_installs_the_dependencies_of_pyproject_and_its_extras():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = _requirements_module().requirements
    deps = pyproject["project"]["dependencies"]
    build = pyproject["build-system"]["requires"]
    optional = pyproject["project"]["optional-dependencies"]
    assert reqs(pyproject, []) == build + deps
    assert reqs(pyproject, ["cuda12"]) == build + deps + optional["cuda12"]
    # dev names jaxllm[test,bench]: their requirements, never jaxllm itself
    dev = reqs(pyproject, ["dev"])
    assert set(dev) == set(build + deps + optional["test"] + optional["bench"]) | {
        r for r in optional["dev"] if not r.startswith("jaxllm[")
    }
    with pytest.raises(SystemExit, match="JAXLLM_EXTRAS: unknown extra 'cuda11'"):
        reqs(pyproject, ["cuda11"])
