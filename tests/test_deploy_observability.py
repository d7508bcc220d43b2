"""docker-compose.yml's observability profile and the Grafana dashboard, checked without a
Docker engine (none runs here): the services and the files they mount, Prometheus scraping
web with the token, Grafana loading the dashboard from its data source, and every metric the
dashboard queries being one /metrics serves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from config import metrics as scrape
from runs import metrics

BASE_DIR = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DASHBOARD = json.loads((BASE_DIR / "deploy" / "grafana" / "djflow.json").read_text())
# CONTRACT section 11's names, as Prometheus shows them (a counter's samples end in _total).
CONTRACT = {
    "djflow_workflow_executions_total",
    "djflow_workflow_duration_seconds_bucket",
    "djflow_step_attempts_total",
    "djflow_step_duration_seconds_bucket",
    "djflow_runs",
    "djflow_timers_due",
    "djflow_model_tokens_total",
    "djflow_cost_usd_total",
    "djflow_model_calls_in_flight",
}
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def _mounts(service: str) -> dict[str, str]:
    """A service's mounts: target in the container -> source (a path or a volume's name)."""
    found = {}
    for entry in SERVICES[service].get("volumes", []):
        source, target = entry.split(":")[:2]
        found[target] = source
    return found


def _host_file(source: str) -> Path:
    assert source.startswith("./"), f"{source} is not a file of the repository"
    return BASE_DIR / source


@pytest.fixture(scope="module")
def exported(django_db_setup, django_db_blocker) -> set[str]:
    """Every sample name /metrics can serve: the counted metrics of runs.metrics, and the
    families the scrape reads from the database and the broker."""
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    with django_db_blocker.unblock():
        for family in scrape.registry().collect():
            names |= {sample.name for sample in family.samples}
    return names


def test_plain_up_is_unchanged_and_the_profile_adds_prometheus_and_grafana() -> None:
    profiled = {name for name, service in SERVICES.items() if service.get("profiles")}
    assert profiled == {"prometheus", "grafana"}
    for name in profiled:
        assert SERVICES[name]["profiles"] == ["observability"]
        # Neither listens beyond this machine.
        assert all(port.startswith("127.0.0.1:") for port in SERVICES[name]["ports"])


def test_web_and_worker_share_the_metrics_folder_and_web_runs_the_gunicorn_hooks() -> None:
    environment = COMPOSE["x-app"]["environment"]
    folder = environment["DJFLOW_METRICS_DIR"]
    assert environment["DJFLOW_METRICS_TOKEN"] == "${DJFLOW_METRICS_TOKEN:-}"
    for service in ("web", "worker"):
        assert _mounts(service)[folder] == "metrics", service
    assert "metrics" in COMPOSE["volumes"]
    assert "gunicorn -c python:config.gunicorn config.wsgi:application" in " ".join(
        SERVICES["web"]["command"]
    )
    # The image makes the folder, so a new volume mounted there belongs to its user.
    dockerfile = (BASE_DIR / "config" / "docker" / "Dockerfile").read_text()
    assert 'mkdir -p "$DJFLOW_VAR_DIR/metrics"' in dockerfile
    assert folder == "/app/var/metrics" and "DJFLOW_VAR_DIR=/app/var" in dockerfile


def test_prometheus_scrapes_web_with_the_token_from_a_secret() -> None:
    prometheus = SERVICES["prometheus"]
    mounts = _mounts("prometheus")
    config_file = _host_file(mounts["/etc/prometheus/prometheus.yml"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = yaml.safe_load(config_file.read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    [targets] = job["static_configs"]
    host, port = targets["targets"][0].split(":")
    assert host in SERVICES and host == "web" and f"{port}:{port}" in SERVICES["web"]["ports"][0]
    # web answers to that host name.
    assert "web" in COMPOSE["x-app"]["environment"]["ALLOWED_HOSTS"]
    [secret] = prometheus["secrets"]
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": f"/run/secrets/{secret}",
    }
    assert COMPOSE["secrets"][secret] == {"environment": "DJFLOW_METRICS_TOKEN"}


def test_grafana_loads_the_dashboard_from_its_provisioned_prometheus() -> None:
    mounts = _mounts("grafana")
    provisioning = _host_file(mounts["/etc/grafana/provisioning"])
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "djflow.yml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    [file] = [s for t, s in mounts.items() if t.startswith(folder + "/")]
    assert _host_file(file) == BASE_DIR / "deploy" / "grafana" / "djflow.json"
    uids = {panel["datasource"]["uid"] for panel in _panels()}
    uids |= {target["datasource"]["uid"] for panel in _panels() for target in panel["targets"]}
    assert uids == {source["uid"]}
    # Grafana refuses to start without an admin password instead of taking admin/admin.
    assert SERVICES["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == (
        "${GRAFANA_ADMIN_PASSWORD:-}"
    )
    assert "exit 1" in " ".join(SERVICES["grafana"]["entrypoint"])


def _panels() -> list[dict[str, Any]]:
    return [panel for panel in DASHBOARD["panels"] if panel["type"] != "row"]


def _queried() -> set[str]:
    exprs = [target["expr"] for panel in _panels() for target in panel["targets"]]
    exprs += [v["query"]["query"] for v in DASHBOARD["templating"]["list"]]
    return {name for expr in exprs for name in re.findall(r"\bdjflow_\w+", expr)}


@pytest.mark.django_db
def test_every_metric_the_dashboard_queries_is_served_and_the_contracts_are(exported) -> None:
    queried = _queried()
    assert len(queried) >= 12  # guards the pattern: finding none would prove nothing
    assert queried <= exported, queried - exported
    assert exported >= CONTRACT, CONTRACT - exported
    # The dashboard shows every contract metric too.
    assert queried >= CONTRACT, CONTRACT - queried
