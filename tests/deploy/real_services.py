"""The real programs the deploy/ tests run (jaxllm servers, Debian's nginx and Prometheus), each on a free
port in a temporary folder, stopped when its `with` block ends; and deploy/'s files rendered for them with
only addresses, ports and paths filled in.

    need("nginx", "nginx-light")          the program's path; missing: fails in CI naming the package
    JaxllmServer(port) / Nginx(conf) / Prometheus(config)   subprocesses with their logs in files
    render_nginx(upstreams, listen)       deploy/nginx/jaxllm.conf.template's two variables filled in
    nginx_main_conf(dir, include)         the http {} wrapper the official nginx image gives conf.d files
    render_prometheus(targets)            deploy/prometheus/prometheus.yml with its targets and rule paths
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NGINX_TEMPLATE = DEPLOY / "nginx" / "jaxllm.conf.template"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "jaxllm.json"
TEMPLATE_VARIABLES = ("JAXLLM_UPSTREAM_SERVERS", "JAXLLM_LISTEN")


def need(program: str, package: str) -> str:
    """The program's path (Debian puts nginx in /usr/sbin, which a user's PATH may lack); without it the
    test fails in CI, naming the Debian package, and skips elsewhere."""
    path = shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/bin")
    if path is None:
        message = f"{program} is missing: install the Debian package {package} (scripts/test-services.txt)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Service:
    """A subprocess with its output in `log`; ready when `ready_url` answers 200."""

    def __init__(self, name: str, argv: list[str], log: Path, ready_url: str, env: dict | None = None):
        self.name, self.argv, self.log, self.ready_url, self.env = name, argv, log, ready_url, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if http_get(self.ready_url, timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def jaxllm_server(port: int, log: Path) -> Service:
    """`jaxllm serve` on the embedded model, as a user starts it (the CLI in its own process)."""
    argv = [sys.executable, "-m", "jaxllm.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--max-model-len", "512", "--max-num-seqs", "8", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return Service(f"jaxllm:{port}", argv, log, f"http://127.0.0.1:{port}/health", env)


def render_nginx(upstreams: list[str], listen: str, template: str | None = None) -> str:
    """The template with its two variables filled in, as the official image's envsubst does (only the
    variables it is given; nginx's own $host, $remote_addr, ... stay)."""
    text = NGINX_TEMPLATE.read_text() if template is None else template
    values = {
        "JAXLLM_UPSTREAM_SERVERS": " ".join(f"server {u};" for u in upstreams),
        "JAXLLM_LISTEN": listen,
    }
    out = re.sub(r"\$\{(JAXLLM_[A-Z_]+)\}", lambda m: values[m.group(1)], text)
    assert "${" not in out, "a variable of the template was left unfilled"
    return out


def nginx_main_conf(folder: Path, include: Path) -> str:
    """What the official nginx image's nginx.conf gives a conf.d file (the http {} block around it), with
    every path in `folder`."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers need the temp folder under pytest's tmp
    return (
        f"{user}daemon off;\nworker_processes 1;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log info;\n"
        "events { worker_connections 256; }\n"
        "http {\n"
        f"    access_log {folder}/access.log;\n"
        f"    client_body_temp_path {folder}/client_body;\n    proxy_temp_path {folder}/proxy;\n"
        f"    fastcgi_temp_path {folder}/fastcgi;\n    uwsgi_temp_path {folder}/uwsgi;\n"
        f"    scgi_temp_path {folder}/scgi;\n"
        f"    include {include};\n"
        "}\n"
    )


def nginx(folder: Path, upstreams: list[str], template: str | None = None) -> tuple[Service, str]:
    """nginx on a free port in front of `upstreams` (host:port); returns the service and its base URL."""
    binary = need("nginx", "nginx-light")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    site = folder / "jaxllm.conf"
    site.write_text(render_nginx(upstreams, f"127.0.0.1:{port}", template))
    conf = folder / "nginx.conf"
    conf.write_text(nginx_main_conf(folder, site))
    argv = [binary, "-p", str(folder), "-c", str(conf), "-e", str(folder / "error.log")]
    url = f"http://127.0.0.1:{port}"
    return Service("nginx", argv, folder / "nginx.out", f"{url}/health"), url


def render_prometheus(targets: list[str]) -> str:
    """deploy/prometheus/prometheus.yml with the jaxllm job's targets and absolute rule file paths."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / p) for p in config["rule_files"]]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "jaxllm"]
    job["static_configs"] = [{"targets": targets}]
    return yaml.safe_dump(config, sort_keys=False)


def prometheus(folder: Path, targets: list[str]) -> tuple[Service, str]:
    binary = need("prometheus", "prometheus")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(render_prometheus(targets))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}"]
    argv += [f"--web.listen-address=127.0.0.1:{port}"]
    return Service("prometheus", argv, folder / "prometheus.log", f"{url}/-/ready"), url
