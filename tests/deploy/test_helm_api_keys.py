"""API keys in the Helm chart: without them the orchestrators take no key file; with a
Secret of yours or one the chart makes from the values, the key file is mounted
read-only into the orchestrators only and passed as --api-keys with the default
limits, the rendered objects validate against the Kubernetes schemas, and values that
cannot work are refused. (Every ci/ values file, api-keys-values.yaml included, is also
linted, validated and parsed with the real command lines by test_helm_chart.py.)"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.conftest import CHART, manifests
from tests.deploy.test_helm_chart import PREFIX, arguments, objects, pod_specs

API_KEYS_VALUES = CHART / "ci" / "api-keys-values.yaml"
ORCHESTRATOR = f"{PREFIX}-orchestrator"


def orchestrator_of(docs: list[dict]) -> tuple[dict, dict]:
    """The orchestrator's pod spec and its container."""
    pod = pod_specs(docs)[ORCHESTRATOR]
    (container,) = pod["containers"]
    return pod, container


def api_key_flags(container: dict) -> dict[str, str]:
    return {
        name: value
        for name, value in arguments(container).items()
        if name == "api-keys" or name.endswith("-per-key")
    }


def test_without_keys_the_api_is_open(render):
    docs = manifests(render())
    pod, container = orchestrator_of(docs)
    assert api_key_flags(container) == {}
    assert "api-keys" not in {volume["name"] for volume in pod["volumes"]}
    assert not objects(docs, "Secret")


def test_keys_from_the_values_make_a_secret_mounted_into_the_orchestrators(render):
    docs = manifests(render(API_KEYS_VALUES))
    (secret,) = objects(docs, "Secret").values()
    assert secret["metadata"]["name"] == f"{PREFIX}-api-keys"
    keys = yaml.safe_load(API_KEYS_VALUES.read_text())["apiKeys"]["keys"]
    assert secret["stringData"] == {"api-keys": keys}
    pod, container = orchestrator_of(docs)
    assert api_key_flags(container) == {
        "api-keys": "/api-keys/api-keys",
        "max-concurrent-per-key": "4",
        "tokens-per-minute-per-key": "6000",
    }
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["api-keys"]["secret"] == {
        "secretName": f"{PREFIX}-api-keys",
        "defaultMode": 0o440,
    }
    # A directory, not a subPath: an updated Secret reaches the running pod.
    mount = {"name": "api-keys", "mountPath": "/api-keys", "readOnly": True}
    assert mount in container["volumeMounts"]
    # Health stays open for the kubelet's probes.
    assert "auth-health" not in arguments(container)
    for name, other in pod_specs(docs).items():
        if name != ORCHESTRATOR:
            assert "api-keys" not in {v["name"] for v in other["volumes"]}, name


def test_an_existing_secret_is_mounted_and_none_is_made(render, kubernetes_validate, tmp_path):
    rendered = render(sets=("apiKeys.existingSecret=team-keys", "apiKeys.secretKey=keys.txt"))
    docs = manifests(rendered)
    assert not objects(docs, "Secret")
    pod, container = orchestrator_of(docs)
    assert api_key_flags(container) == {"api-keys": "/api-keys/keys.txt"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "team-keys"
    path = tmp_path / "release.yaml"
    path.write_text(rendered.stdout)
    validated = subprocess.run(
        [str(kubernetes_validate), "--strict", "--quiet", "--kubernetes-version=1.29.0", str(path)],
        capture_output=True,
        text=True,
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr


INVALID = {
    "two sources of keys": (
        ("apiKeys.existingSecret=team-keys", "apiKeys.keys=alice:0123456789abcdef"),
        "apiKeys: set existingSecret (a Secret you made) or keys (the chart makes one), not both",
    ),
    "limits without keys": (
        ("apiKeys.maxConcurrentPerKey=2",),
        "apiKeys.maxConcurrentPerKey and apiKeys.tokensPerMinutePerKey limit API keys",
    ),
    "a negative limit": (
        ("apiKeys.keys=alice:0123456789abcdef", "apiKeys.tokensPerMinutePerKey=-1"),
        "apiKeys.tokensPerMinutePerKey: Must be greater than or equal to 0",
    ),
}


@pytest.mark.parametrize("problem", INVALID)
def test_invalid_api_key_values_are_refused(render, problem):
    sets, message = INVALID[problem]
    result = render(sets=sets)
    assert result.returncode != 0 and message in result.stderr, result.stderr
