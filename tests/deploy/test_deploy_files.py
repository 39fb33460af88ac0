"""deploy/'s files checked without starting a server: Prometheus' own checker and rule unit tests, nginx's
own syntax check of the rendered template, docker-compose's own reading of the compose file, and the files
agreeing with each other and with jaxllm (every command line parses with `jaxllm serve`'s parser; ports,
paths, service names and variables match).
The same files run for real in test_nginx_prometheus.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from jaxllm.server.cli import parse_args
from tests.deploy.promql_names import dashboard_queries, metric_names
from tests.deploy.real_services import (
    DASHBOARD,
    DEPLOY,
    NGINX_TEMPLATE,
    PROMETHEUS_CONFIG,
    TEMPLATE_VARIABLES,
    free_port,
    need,
    nginx_main_conf,
    render_nginx,
)

RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
# the compose file's variables (left unset, so their defaults are what is checked)
COMPOSE_VARIABLES = ("MODEL", "SERVED_MODEL_NAME", "MAX_MODEL_LEN", "HF_TOKEN", "JAXLLM_", "GRAFANA_")


def _run(argv: list[str], cwd: Path | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120)
    assert r.returncode == 0, f"{argv} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_promtool_checks_the_config_and_the_rules():
    promtool = need("promtool", "prometheus")
    out = _run([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert f"SUCCESS: {len(RULES)} rule files found" in out
    out = _run([promtool, "check", "rules", *map(str, RULES)])
    assert out.count("SUCCESS") == len(RULES)


def test_rules_record_and_alert_as_computed_by_hand():
    promtool = need("promtool", "prometheus")
    _run([promtool, "test", "rules", "alert_rules_test.yml"], cwd=Path(__file__).parent)


def test_nginx_accepts_the_rendered_template(tmp_path):
    binary = need("nginx", "nginx-light")
    site = tmp_path / "jaxllm.conf"
    site.write_text(
        render_nginx([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], f"127.0.0.1:{free_port()}")
    )
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_main_conf(tmp_path, site))
    out = _run([binary, "-t", "-p", str(tmp_path), "-c", str(conf), "-e", str(tmp_path / "error.log")])
    assert "syntax is ok" in out and "test is successful" in out


def test_the_template_keeps_the_streaming_directives():
    """The directives a stream depends on, each once, in the proxied location (a change that drops one
    fails here before the live tests show tokens bunched up)."""
    text = NGINX_TEMPLATE.read_text()
    assert sorted(set(re.findall(r"\$\{(\w+)\}", text))) == sorted(TEMPLATE_VARIABLES)
    location = text.split("location / {", 1)[1].split("\n    }", 1)[0]
    for directive in [
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_read_timeout 3600s;",
        "proxy_ignore_client_abort off;",
    ]:
        assert location.count(directive) == 1, directive
    upstream = text.split("upstream jaxllm {", 1)[1].split("\n}", 1)[0]
    assert re.search(r"^\s*keepalive \d+;", upstream, re.M) and "least_conn;" in upstream


@pytest.fixture(scope="module")
def compose() -> dict:
    """The compose file as docker-compose itself resolves it (schema checked, ${VAR:-default} filled in with
    the defaults, the shared x-jaxllm block merged); relative paths become absolute."""
    binary = need("docker-compose", "docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(COMPOSE_VARIABLES)}
    r = subprocess.run(
        [binary, "-f", str(DEPLOY / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def _mounts(service: dict) -> dict[str, Path | str]:
    """A service's mounts, target -> source (a path for a bind mount, a name for a volume)."""
    out = {}
    for v in service["volumes"]:
        source, target = v.split(":")[:2]
        out[target] = Path(source) if source.startswith("/") else source
    return out


def test_compose_services_agree_with_each_other_and_with_jaxllm(compose):
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("jaxllm-"))
    assert len(replicas) >= 2
    gpus = set()
    for name in replicas:
        s = services[name]
        args = parse_args(s["command"])  # `jaxllm serve`'s own parser: exits on a flag it does not know
        assert args.server.port == 8000, name
        assert f"http://127.0.0.1:{args.server.port}/health" in " ".join(s["healthcheck"]["test"])
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        gpus.update(device["device_ids"])
        # The image's cache folders (its VOLUMEs) on named volumes, shared by the replicas
        mounts = _mounts(s)
        assert mounts["/home/jaxllm/.cache/jaxllm"] in compose["volumes"]
        assert mounts["/home/jaxllm/.cache/huggingface"] in compose["volumes"]
    assert len(gpus) == len(replicas), "each replica needs a GPU of its own"

    nginx = services["nginx"]
    assert sorted(nginx["environment"]) == sorted(TEMPLATE_VARIABLES)
    upstreams = re.findall(r"server (\S+?)(?: |;)", nginx["environment"]["JAXLLM_UPSTREAM_SERVERS"])
    assert upstreams == [f"{name}:8000" for name in replicas]
    (port,) = nginx["ports"]
    assert str(port["target"]) == nginx["environment"]["JAXLLM_LISTEN"]
    ((target, source),) = _mounts(nginx).items()
    assert source == NGINX_TEMPLATE and re.fullmatch(r"/etc/nginx/templates/\w+\.conf\.template", target)

    prom = services["prometheus"]
    (config_dir,) = [t for t, s in _mounts(prom).items() if s == PROMETHEUS_CONFIG.parent]
    assert f"--config.file={config_dir}/{PROMETHEUS_CONFIG.name}" in prom["command"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "jaxllm"]
    assert job["static_configs"][0]["targets"] == upstreams  # every replica scraped directly

    grafana = services["grafana"]
    mounts = {s: t for t, s in _mounts(grafana).items()}
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts[provisioning] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "jaxllm.yml").read_text())["providers"]
    assert mounts[DASHBOARD.parent] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    (prom_port,) = prom["ports"]
    assert source["url"] == f"http://prometheus:{prom_port['target']}"
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


def test_kubernetes_manifest_agrees_with_itself_and_with_jaxllm():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "jaxllm.yaml").read_text())}
    deployment, service, claim = docs["Deployment"], docs["Service"], docs["PersistentVolumeClaim"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.server.port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ports, probe
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 600
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] in ports
    annotations = pod["metadata"]["annotations"]
    assert (
        int(annotations["prometheus.io/port"]) == args.server.port
        and annotations["prometheus.io/path"] == "/metrics"
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"/home/jaxllm/.cache/jaxllm", "/home/jaxllm/.cache/huggingface"}


def test_dashboard_panels_and_variables():
    """Every panel queries through the datasource variable; the prefix variable offers both names."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert [o["value"] for o in variables["prefix"]["options"]] == ["jaxllm", "vllm"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ["first token", "per output token", "inter-token", "running", "waiting", "kv cache",
                  "throughput", "preemptions", "errors"]:  # fmt: skip
        assert topic in titles, topic
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    for prefix in ("jaxllm", "vllm"):
        queries = dashboard_queries(dashboard, prefix)
        assert all(metric_names(q) for q in queries)
        assert all("$" not in q for q in queries), [q for q in queries if "$" in q]


def test_promql_names_reads_names_not_labels_functions_or_numbers():
    q = (
        'histogram_quantile(0.99, sum by (le, instance) (rate(vllm:x_seconds_bucket{a=~"b|c", d="1e3"}[5m])))'
        ' / on (instance) group_left sum(up{job="j"}) > bool 1e-3 offset 5m'
    )
    assert metric_names(q) == {"vllm:x_seconds_bucket", "up"}
    assert metric_names('label_values(jaxllm:num_requests_running{model_name=~".*"}, instance)') == {
        "jaxllm:num_requests_running"
    }
