"""The chart's TLS (values `tls.*`): Secrets in cert-manager's layout mounted read-only,
the servers' and the orchestrators' TLS flags pointing into them, the probes on the
plaintext health port of a TLS server (the kubelet's gRPC probes cannot do TLS) and that
port open to no other pod; without a Secret, nothing of it. The release's manifests are
validated strictly with the others' (`test_helm_chart.py`, the `tls` case, where the
refused TLS values are listed with the others); here, what they say."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.conftest import CHART, manifests
from tests.deploy.test_helm_chart import PREFIX, arguments, objects, pod_specs

TLS_VALUES = CHART / "ci" / "tls-values.yaml"
SERVICES = [f"{PREFIX}-trunk", f"{PREFIX}-jury-a", f"{PREFIX}-jury-b"]
ORCHESTRATOR = f"{PREFIX}-orchestrator"
TLS_FLAGS = {
    *("tls-cert", "tls-key", "tls-ca", "health-listen"),
    *("internal-tls-ca", "internal-tls-cert", "internal-tls-key", "internal-tls-server-name"),
}


@pytest.fixture(scope="module")
def release(render) -> list[dict]:
    return manifests(render(TLS_VALUES))


def server(docs: list[dict], name: str) -> tuple[dict, dict]:
    """The pod spec of Deployment `name` and its one container."""
    pod = pod_specs(docs)[name]
    (container,) = pod["containers"]
    return pod, container


def mounted_secrets(pod: dict, container: dict) -> dict[str, str]:
    """Mount path → Secret name, for every Secret volume the container mounts; each is
    read-only and readable by the pod's group only."""
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    secrets = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is not None:
            assert mount["readOnly"] is True
            assert secret["defaultMode"] == 0o440
            secrets[mount["mountPath"]] = secret["secretName"]
    return secrets


@pytest.mark.parametrize("name", SERVICES)
def test_the_services_are_mtls_over_their_secret(release, name):
    pod, container = server(release, name)
    assert mounted_secrets(pod, container) == {"/tls/internal": "hydra-jury-services-tls"}
    flags = arguments(container)
    assert (flags["tls-cert"], flags["tls-key"], flags["tls-ca"]) == (
        "/tls/internal/tls.crt",
        "/tls/internal/tls.key",
        "/tls/internal/ca.crt",
    )


def test_the_orchestrators_are_the_services_clients_and_serve_tls(release):
    pod, container = server(release, ORCHESTRATOR)
    assert mounted_secrets(pod, container) == {
        "/tls/internal": "hydra-jury-orchestrator-tls",
        "/tls/public": "hydra-jury-api-tls",
    }
    flags = arguments(container)
    assert flags["internal-tls-ca"] == "/tls/internal/ca.crt"
    assert flags["internal-tls-cert"] == "/tls/internal/tls.crt"
    assert flags["internal-tls-key"] == "/tls/internal/tls.key"
    # kubernetes discovery connects to pod IPs: the certificates' one name is verified
    assert flags["discovery"] == "kubernetes"
    assert flags["internal-tls-server-name"] == "hydra-jury.internal"
    assert (flags["tls-cert"], flags["tls-key"], flags["tls-ca"]) == (
        "/tls/public/tls.crt",
        "/tls/public/tls.key",
        "/tls/public/ca.crt",
    )


@pytest.mark.parametrize("name", [*SERVICES, ORCHESTRATOR])
def test_probes_ask_the_plaintext_health_port_which_no_pod_may_reach(release, name):
    _, container = server(release, name)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["health"] == 50059 != ports["grpc"]
    assert arguments(container)["health-listen"] == "0.0.0.0:50059"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"], probe
    for policy in objects(release, "NetworkPolicy").values():
        for rule in policy["spec"]["ingress"]:
            assert {"protocol": "TCP", "port": ports["health"]} not in rule.get("ports", [])


def test_the_services_secret_is_the_orchestrators_client_certificate_by_default(render, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"tls": {"internal": {"secretName": "hydra-jury-tls"}}}))
    docs = manifests(render(values))
    pod, container = server(docs, ORCHESTRATOR)
    assert mounted_secrets(pod, container) == {"/tls/internal": "hydra-jury-tls"}
    flags = arguments(container)
    assert flags["internal-tls-cert"] == "/tls/internal/tls.crt"
    # static discovery: each Service's name is verified; the public port stays plaintext
    assert "internal-tls-server-name" not in flags and "tls-cert" not in flags
    assert container["readinessProbe"]["grpc"]["port"] == 50050


def test_without_a_secret_nothing_is_tls(render):
    docs = manifests(render())
    for name in [*SERVICES, ORCHESTRATOR]:
        pod, container = server(docs, name)
        assert not mounted_secrets(pod, container)
        assert not TLS_FLAGS & set(arguments(container))
        assert "health" not in {port["name"] for port in container["ports"]}
