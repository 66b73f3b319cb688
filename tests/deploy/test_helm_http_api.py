"""The chart's OpenAI-compatible HTTP API (`orchestrator.http`): off by default; enabled,
the orchestrators serve it on a container port and their Service on a port named
`http` (HTTPS with the public certificate in the `tls` case, which enables it), and
nothing else of the chart changes for it. The manifests are validated strictly with the
others' (`test_helm_chart.py`)."""

from __future__ import annotations

import pytest

from tests.deploy.conftest import CHART, manifests
from tests.deploy.test_helm_chart import PREFIX, arguments, objects, pod_specs

ORCHESTRATOR = f"{PREFIX}-orchestrator"


def orchestrator(docs: list[dict]) -> tuple[dict, dict]:
    """The orchestrators' container and their Service."""
    (container,) = pod_specs(docs)[ORCHESTRATOR]["containers"]
    return container, objects(docs, "Service")[ORCHESTRATOR]


@pytest.fixture(scope="module")
def enabled(render) -> list[dict]:
    return manifests(render(CHART / "ci" / "tls-values.yaml"))


def test_enabled_it_has_a_port_on_the_pods_and_the_service(enabled):
    container, service = orchestrator(enabled)
    flags = arguments(container)
    assert flags["http-listen"] == "0.0.0.0:8080"
    assert "served-model-name" not in flags  # the checkpoint's name
    assert flags["tls-cert"] == "/tls/public/tls.crt"  # the same certificate: HTTPS
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["http"] == 8080
    http = next(port for port in service["spec"]["ports"] if port["name"] == "http")
    assert (http["port"], http["targetPort"]) == (8080, "http")


def test_off_by_default(render):
    container, service = orchestrator(manifests(render()))
    assert "http-listen" not in arguments(container)
    assert "http" not in {port["name"] for port in container["ports"]}
    assert [port["name"] for port in service["spec"]["ports"]] == ["grpc"]


def test_its_ports_are_set_by_the_values(render):
    container, service = orchestrator(
        manifests(
            render(
                sets=(
                    "orchestrator.http.enabled=true",
                    "orchestrator.http.port=9000",
                    "orchestrator.service.httpPort=80",
                    "orchestrator.http.servedModelName=demo",
                )
            )
        )
    )
    assert arguments(container)["http-listen"] == "0.0.0.0:9000"
    assert arguments(container)["served-model-name"] == "demo"
    http = next(port for port in service["spec"]["ports"] if port["name"] == "http")
    assert http["port"] == 80
