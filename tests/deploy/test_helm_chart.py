"""The Helm chart (no Kubernetes API server runs here): `helm lint`, `helm template` of
the defaults and of every values file in the chart's ci/ folder, each manifest validated
strictly against the schemas of Kubernetes 1.29 and of the newest version
kubernetes-validate knows, and the rendered objects read back: a Deployment and a
Service per shard carrying its heads, gRPC probes, NetworkPolicies, non-root locked-down
containers with requests and limits, the checkpoint read-only, arguments that the real
command lines accept. Invalid values are refused with a message naming the problem."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable

import pytest
import yaml
from kubernetes_validate.utils import latest_version

from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.orchestrator.__main__ import build_parser as orchestrator_parser
from hydra_jury.orchestrator.limits import RequestLimits, limits_from
from hydra_jury.serving.worker_service import build_parser as service_parser
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from tests.deploy.conftest import CHART, RELEASE, manifests, refusal

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
CASES = {"defaults": None} | {
    path.name.removesuffix("-values.yaml"): path for path in sorted(CHART.glob("ci/*-values.yaml"))
}
PREFIX = f"{RELEASE}-hydra-jury"
OPERATOR_KINDS = ("ServiceMonitor", "PrometheusRule")  # the Prometheus Operator's CRDs
SERVERS = {"trunk", "jury", "orchestrator"}  # the first argument of hydra-jury's containers
PARSERS = {
    "trunk": lambda: service_parser(TRUNK_SERVICE, "hydra-jury trunk"),
    "jury": lambda: service_parser(JURY_SERVICE, "hydra-jury jury"),
    "orchestrator": lambda: orchestrator_parser("hydra-jury orchestrator"),
}


def values_of(case: str) -> dict:
    """The values a case sets (its file alone; the chart's defaults fill the rest)."""
    path = CASES[case]
    return yaml.safe_load(path.read_text()) if path else {}


def shards_of(case: str) -> list[dict]:
    return values_of(case).get("jury", {}).get("shards", DEFAULTS["jury"]["shards"])


@pytest.fixture(scope="module")
def releases(render) -> dict[str, list[dict]]:
    return {case: manifests(render(*[p for p in [path] if p])) for case, path in CASES.items()}


def every(items: Iterable, what: str) -> list:
    """`items` as a list, asserted non-empty: a loop over nothing would check nothing."""
    items = list(items)
    assert items, f"no {what} rendered: the check would pass on nothing"
    return items


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"] for name, d in objects(docs, "Deployment").items()}


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def servers(docs: list[dict]) -> list[dict]:
    """The hydra-jury server containers of every Deployment."""
    return [
        container
        for pod in pod_specs(docs).values()
        for container in pod["containers"]
        if container["args"][0] in SERVERS
    ]


def arguments(container: dict) -> dict[str, str]:
    """--name=value -> {name: value}; a bare --flag (a switch) -> {flag: ""}."""
    pairs = (arg.removeprefix("--").partition("=") for arg in container["args"][1:])
    return {name: value for name, _, value in pairs}


def matches(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def test_the_ci_values_files_cover_the_cases():
    assert {"one-shard", "three-shards", "external-redis", "bundled-redis", "tls"} <= set(CASES)
    assert {"drain-and-limits", "observability"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_helm_lint(helm, case):
    values = [f"--values={CASES[case]}"] if CASES[case] else []
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_validates_strictly(render, kubernetes_validate, tmp_path):
    files = []
    for case, path in CASES.items():
        rendered = render(*[p for p in [path] if p])
        assert rendered.returncode == 0, rendered.stderr
        files.append(tmp_path / f"{case}.yaml")
        files[-1].write_text(rendered.stdout)
    versions = ["1.29.0", latest_version()]
    assert [int(part) for part in versions[1].split(".")] > [1, 29, 0], versions
    result = subprocess.run(
        [str(kubernetes_validate), "--strict", "--quiet"]
        + [f"--kubernetes-version={version}" for version in versions]
        + [str(file) for file in files],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # A kind without a schema is only a warning: a mistyped apiVersion would pass silently.
    # Only the Prometheus Operator's custom resources may lack one (the PrometheusRule's
    # rules are checked by promtool, test_alerts.py).
    custom = [f"kind {kind} with api version monitoring.coreos.com/v1 " for kind in OPERATOR_KINDS]
    unchecked = [line for line in result.stdout.splitlines() if not any(c in line for c in custom)]
    assert not unchecked, unchecked


@pytest.mark.parametrize("case", CASES)
def test_one_deployment_and_service_per_shard_with_its_heads(releases, case):
    docs = releases[case]
    deployments, services = objects(docs, "Deployment"), objects(docs, "Service")
    jury_deployments = {n for n in deployments if n.startswith(f"{PREFIX}-jury-")}
    assert jury_deployments == {f"{PREFIX}-jury-{shard['name']}" for shard in shards_of(case)}
    for shard in every(shards_of(case), "jury shards"):
        name = f"{PREFIX}-jury-{shard['name']}"
        (server,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert server["args"][0] == "jury"
        assert arguments(server)["heads"] == ",".join(shard["heads"])
        service = services[name]
        assert [port["name"] for port in service["spec"]["ports"]] == ["grpc"]
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        # The selector tells the shards apart: a Service never reaches another shard.
        others = [d for n, d in deployments.items() if n != name]
        assert not any(
            service["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in others
        )


@pytest.mark.parametrize("case", CASES)
def test_every_server_has_grpc_probes(releases, case):
    for container in every(servers(releases[case]), "servers"):
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"]
        if "health-listen" in arguments(container):  # a TLS port: its plaintext health port
            (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "health"]
            assert arguments(container)["health-listen"] == f"0.0.0.0:{port}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (container["name"], probe)
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading"
        assert container["readinessProbe"]["grpc"]["service"].startswith("hydrajury.v1.")


@pytest.mark.parametrize("case", CASES)
def test_only_orchestrators_reach_trunk_shards_and_redis(releases, case):
    docs = releases[case]
    deployments = objects(docs, "Deployment")
    policies = list(objects(docs, "NetworkPolicy").values())
    orchestrator_labels = deployments[f"{PREFIX}-orchestrator"]["spec"]["template"]["metadata"][
        "labels"
    ]
    protected = [name for name in deployments if not name.endswith("-orchestrator")]
    assert f"{PREFIX}-trunk" in protected and len(protected) >= 2
    for name in protected:
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies if matches(p["spec"]["podSelector"], labels)]
        assert selecting, f"no NetworkPolicy selects {name}"
        for policy in selecting:  # not empty: asserted above
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            for rule in every(policy["spec"]["ingress"], "ingress rules"):
                if rule["ports"] == [{"protocol": "TCP", "port": 9100}]:
                    continue  # the metrics port: test_metrics_are_scraped_from_every_server
                for peer in every(rule["from"], "ingress peers"):
                    assert set(peer) == {"podSelector"}, peer
                    assert matches(peer["podSelector"], orchestrator_labels)
                    other_pods = [
                        d for n, d in deployments.items() if n.endswith(("-trunk", "-redis"))
                    ]
                    assert not any(
                        matches(peer["podSelector"], d["spec"]["template"]["metadata"]["labels"])
                        for d in other_pods
                    )


@pytest.mark.parametrize("case", CASES)
def test_no_container_runs_as_root(releases, case):
    for name, pod in every(pod_specs(releases[case]).items(), "pods"):
        pod_context = pod["securityContext"]
        assert pod_context["runAsNonRoot"] is True, name
        assert pod_context["runAsUser"] != 0 and pod_context["seccompProfile"] == {
            "type": "RuntimeDefault"
        }
        assert pod["automountServiceAccountToken"] is False or name.endswith("-orchestrator")
        for container in every(containers(pod), f"containers in {name}"):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("case", CASES)
def test_every_container_has_requests_and_limits(releases, case):
    for name, pod in every(pod_specs(releases[case]).items(), "pods"):
        for container in every(containers(pod), f"containers in {name}"):
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), (name, container["name"], kind)


@pytest.mark.parametrize("case", CASES)
def test_the_checkpoint_is_mounted_read_only(releases, case):
    checked = []
    for name, pod in every(pod_specs(releases[case]).items(), "pods"):
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod["containers"]:
            if container["args"][0] not in SERVERS:
                continue
            checked.append(name)
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "checkpoint"]
            assert mount["readOnly"] is True and mount["mountPath"] == "/checkpoint", name
            assert arguments(container)["checkpoint"] == "/checkpoint"
            # The root filesystem is read-only: /tmp is the writable scratch space.
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
            assert "emptyDir" in volumes["tmp"]
        if "persistentVolumeClaim" in volumes.get("checkpoint", {}):
            assert volumes["checkpoint"]["persistentVolumeClaim"]["readOnly"] is True
    assert len(checked) >= 3, f"servers checked: {checked}"  # trunk, a shard, orchestrator


@pytest.mark.parametrize("case", CASES)
def test_disruption_budgets_and_autoscalers(releases, case):
    docs = releases[case]
    deployments = objects(docs, "Deployment")
    budgets = objects(docs, "PodDisruptionBudget")
    autoscalers = objects(docs, "HorizontalPodAutoscaler")
    for name, deployment in every(deployments.items(), "deployments"):
        if name.endswith("-redis"):
            continue  # one trial instance: nothing to keep available
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert matches(budgets[name]["spec"]["selector"], labels), name
        if name in autoscalers:
            assert autoscalers[name]["spec"]["scaleTargetRef"]["name"] == name
            assert "replicas" not in deployment["spec"], "the autoscaler owns the count"
        else:
            assert deployment["spec"]["replicas"] >= 1
    autoscaled = {
        f"{PREFIX}-jury-{s['name']}"
        for s in shards_of(case)
        if s.get("autoscaling", {}).get("enabled")
    }
    assert autoscaled <= set(autoscalers)


def test_shards_scale_on_their_own(releases):
    docs = releases["three-shards"]
    deployments = objects(docs, "Deployment")
    autoscalers = objects(docs, "HorizontalPodAutoscaler")
    assert deployments[f"{PREFIX}-jury-small"]["spec"]["replicas"] == 1
    assert (autoscalers[f"{PREFIX}-jury-medium"]["spec"]["maxReplicas"]) == 3
    large = autoscalers[f"{PREFIX}-jury-large"]["spec"]
    assert (large["minReplicas"], large["maxReplicas"]) == (2, 6)
    assert large["metrics"][0]["type"] == "Pods"
    # jury.defaults under each shard's own settings: the large shard keeps the default
    # CPU request and takes two GPUs.
    (server,) = deployments[f"{PREFIX}-jury-large"]["spec"]["template"]["spec"]["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert server["resources"]["requests"]["cpu"] == "2"
    assert arguments(server)["device"] == "cuda"
    assert "threads" not in arguments(server)


@pytest.mark.parametrize("case", CASES)
def test_the_arguments_parse_with_the_real_command_lines(releases, case):
    for container in servers(releases[case]):
        command, *rest = container["args"]
        PARSERS[command]().parse_args(rest)


def test_the_defaults_render_a_complete_trial_release(releases):
    docs = releases["defaults"]
    deployments = pod_specs(docs)
    assert set(deployments) == {
        f"{PREFIX}-{component}"
        for component in ("trunk", "jury-a", "jury-b", "orchestrator", "redis")
    }
    assert set(objects(docs, "Service")) == set(deployments)
    heads = [arguments(c)["heads"] for c in servers(docs) if c["args"][0] == "jury"]
    assert sorted(heads) == ["head0,head1", "head2,head3"]
    checkpoint = {v["name"]: v for v in deployments[f"{PREFIX}-trunk"]["volumes"]}["checkpoint"]
    assert checkpoint["persistentVolumeClaim"] == {
        "claimName": "hydra-checkpoint",
        "readOnly": True,
    }
    (orchestrator,) = deployments[f"{PREFIX}-orchestrator"]["containers"]
    assert {
        "name": "HYDRA_JURY_REDIS_URL",
        "value": f"redis://{PREFIX}-redis:6379/0",
    } in orchestrator["env"]
    flags = arguments(orchestrator)
    assert flags["trunk"] == f"{PREFIX}-trunk:50051"
    assert flags["jury"] == f"{PREFIX}-jury-a:50052,{PREFIX}-jury-b:50052"
    assert "discovery" not in flags and flags["metrics-address"] == "0.0.0.0"


def test_a_draft_model_is_handed_to_the_trunk_only(releases):
    pods = pod_specs(releases["three-shards"])
    trunk = arguments(pods[f"{PREFIX}-trunk"]["containers"][0])
    assert trunk["draft-model"] == "/checkpoint/draft"
    others = [
        arguments(c)
        for name, p in pods.items()
        if name != f"{PREFIX}-trunk"
        for c in p["containers"]
        if c["args"][0] in SERVERS
    ]
    assert others and not any("draft-model" in args for args in others)
    defaults = arguments(pod_specs(releases["defaults"])[f"{PREFIX}-trunk"]["containers"][0])
    assert "draft-model" not in defaults


def test_a_redis_url_switches_to_the_external_redis(releases):
    docs = releases["external-redis"]
    assert not [name for name in objects(docs, "Deployment") if name.endswith("-redis")]
    assert not [doc for doc in docs if doc["metadata"]["name"].endswith("-redis")]
    (orchestrator,) = pod_specs(docs)[f"{PREFIX}-orchestrator"]["containers"]
    env = {variable["name"]: variable for variable in orchestrator["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "hydra-jury-redis",
        "key": "redis-password",
    }
    # Declared before the URL, so that Kubernetes expands $(REDIS_PASSWORD) in it.
    names = [variable["name"] for variable in orchestrator["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("HYDRA_JURY_REDIS_URL")
    assert env["HYDRA_JURY_REDIS_URL"]["value"] == (
        "rediss://:$(REDIS_PASSWORD)@redis.example.internal:6380/2"
    )
    assert arguments(orchestrator)["redis-key-prefix"] == "prod:hydra-jury:"


def test_kubernetes_discovery_gets_the_service_names_and_only_endpointslice_reads(releases):
    docs = releases["external-redis"]
    pod = pod_specs(docs)[f"{PREFIX}-orchestrator"]
    flags = arguments(pod["containers"][0])
    assert flags["discovery"] == "kubernetes"
    assert flags["trunk"] == f"{PREFIX}-trunk"
    assert flags["jury"] == f"{PREFIX}-jury-a,{PREFIX}-jury-b"
    account = f"{PREFIX}-orchestrator"
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    (role,) = objects(docs, "Role").values()
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (binding,) = objects(docs, "RoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    # Static discovery needs no API access at all.
    static = releases["defaults"]
    assert not objects(static, "Role") and not objects(static, "RoleBinding")
    assert pod_specs(static)[account]["automountServiceAccountToken"] is False


def test_each_service_monitor_scrapes_only_its_metrics_service(releases):
    docs = releases["external-redis"]
    monitors = objects(docs, "ServiceMonitor")
    servers = ["orchestrator", "trunk", "jury-a", "jury-b"]
    assert sorted(monitors) == sorted(f"{PREFIX}-{server}-metrics" for server in servers)
    services = objects(docs, "Service")
    deployments = objects(docs, "Deployment")
    for server in servers:
        monitor = monitors[f"{PREFIX}-{server}-metrics"]
        scraped = [
            s
            for s in services.values()
            if matches(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert [s["metadata"]["name"] for s in scraped] == [f"{PREFIX}-{server}-metrics"]
        assert scraped[0]["spec"]["ports"][0]["name"] == monitor["spec"]["endpoints"][0]["port"]
        pods = [
            name
            for name, d in deployments.items()
            if matches(
                {"matchLabels": scraped[0]["spec"]["selector"]},
                d["spec"]["template"]["metadata"]["labels"],
            )
        ]
        assert pods == [f"{PREFIX}-{server}"]
    assert services[f"{PREFIX}-orchestrator"]["spec"]["type"] == "LoadBalancer"
    assert [p["name"] for p in services[f"{PREFIX}-orchestrator"]["spec"]["ports"]] == ["grpc"]


INVALID = {
    "a shard without heads": (
        {"jury": {"shards": [{"name": "a"}]}},
        "jury.shards.0: heads is required",
    ),
    "a shard with no heads": (
        {"jury": {"shards": [{"name": "a", "heads": []}]}},
        "jury.shards.0.heads: Array must have at least 1 items",
    ),
    "negative trunk replicas": (
        {"trunk": {"replicas": -1}},
        "trunk.replicas: Must be greater than or equal to 0",
    ),
    "negative shard replicas": (
        {"jury": {"shards": [{"name": "a", "heads": ["head0"], "replicas": -2}]}},
        "jury.shards.0.replicas: Must be greater than or equal to 0",
    ),
    "an unknown discovery mode": (
        {"discovery": "dns"},
        'discovery: discovery must be one of the following: "static", "kubernetes"',
    ),
    "a mistyped value": ({"jurry": {}}, "Additional property jurry is not allowed"),
    "a hostPath checkpoint without a path": (
        {"checkpoint": {"source": "hostPath"}},
        "checkpoint.hostPath.path: Does not match pattern '^/'",
    ),
    "two shards sharing a head": (
        {
            "jury": {
                "shards": [
                    {"name": "a", "heads": ["head0", "head1"]},
                    {"name": "b", "heads": ["head1", "head2"]},
                ]
            }
        },
        'head "head1" is in shard "a" and in shard "b"; each head must be in exactly one shard',
    ),
    "no shards": ({"jury": {"shards": []}}, "jury.shards is empty"),
    "two shards of one name": (
        {
            "jury": {
                "shards": [{"name": "a", "heads": ["head0"]}, {"name": "a", "heads": ["head1"]}]
            }
        },
        'two shards are named "a"',
    ),
    "no redis": ({"redis": {"enabled": False}}, "set redis.url to your Redis"),
    "a password in the redis url": (
        {"redis": {"url": "redis://:secret@redis:6379/0"}},
        "redis.url carries credentials",
    ),
    "a draft model outside the checkpoint": (
        {"trunk": {"draftModel": "../other"}},
        "trunk.draftModel: Does not match pattern",
    ),
    "a draft model that climbs out": (
        {"trunk": {"draftModel": "draft/../../other"}},
        "trunk.draftModel: Must not validate the schema",
    ),
    "an absolute draft model path": (
        {"trunk": {"draftModel": "/models/draft"}},
        "trunk.draftModel: Does not match pattern",
    ),
    "a password secret without a url": (
        {"redis": {"existingSecret": "hydra-jury-redis"}},
        "redis.existingSecret holds the password of the Redis at redis.url",
    ),
    "a mistyped request limit": (
        {"orchestrator": {"limits": {"newtokens": 5}}},
        "Additional property newtokens is not allowed",
    ),
    "a request limit of 0": (
        {"orchestrator": {"limits": {"beams": 0}}},
        "orchestrator.limits.beams: Must be greater than 0",
    ),
    "a negative pre-stop sleep": (
        {"preStopSleepSeconds": -1},
        "preStopSleepSeconds: Must be greater than or equal to 0",
    ),
    "an unknown log format": (
        {"logFormat": "xml"},
        'logFormat must be one of the following: "text", "json"',
    ),
    "a client certificate without the services' own": (
        {"tls": {"internal": {"clientSecretName": "orchestrator-tls"}}},
        "set tls.internal.secretName (their certificate) too",
    ),
    "kubernetes discovery over TLS without a server name": (
        {"discovery": "kubernetes", "tls": {"internal": {"secretName": "services-tls"}}},
        "tls.internal.serverName is needed with discovery=kubernetes",
    ),
    "client certificates without the public certificate": (
        {"tls": {"public": {"requireClientCertificate": True}}},
        "tls.public.requireClientCertificate needs tls.public.secretName",
    ),
    "a mistyped TLS value": (
        {"tls": {"internal": {"secret": "services-tls"}}},
        "Additional property secret is not allowed",
    ),
    "a health port out of range": (
        {"tls": {"healthPort": 70000}},
        "tls.healthPort: Must be less than or equal to 65535",
    ),
}


@pytest.mark.parametrize("problem", INVALID)
def test_invalid_values_are_refused(render, tmp_path, problem):
    values, message = INVALID[problem]
    assert message in refusal(render, tmp_path, values)


def test_the_notes_render(render, tmp_path):
    """helm template leaves NOTES.txt out, and a failing NOTES.txt fails `helm install`:
    rendered here through a copy of the chart that holds it in a ConfigMap."""
    chart = tmp_path / "hydra-jury"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "notes.txt") . | quote }}}\n'
    )
    for path in [None, *CASES.values()]:
        configmaps = objects(manifests(render(*[p for p in [path] if p], chart=chart)), "ConfigMap")
        notes = configmaps["notes"]
        text = notes["data"]["notes"]
        assert f"service/{PREFIX}-orchestrator" in text and "jury shard" in text


def leaves(values: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every value, down to scalars, lists and empty maps."""
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths += leaves(value, f"{path}.") if isinstance(value, dict) and value else [path]
    return paths


def test_the_chart_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    rows = [line.split("|")[1] for line in readme.splitlines() if line.startswith("| `")]
    documented = {key for cell in rows for key in re.findall(r"`([^`]+)`", cell)}
    # A map whose members are Kubernetes fields (resources, probes, security contexts)
    # is documented as a whole; list items as `list[].member`.
    paths = leaves(DEFAULTS)
    missing = [p for p in paths if not any(p == d or p.startswith(f"{d}.") for d in documented)]
    assert not missing, missing
    unknown = [
        d
        for d in documented
        if d.split("[]")[0] not in paths and not any(p.startswith(f"{d}.") for p in paths)
    ]
    assert not unknown, unknown


@pytest.mark.parametrize("case", CASES)
def test_metrics_are_scraped_from_every_server(releases, case):
    """Every server serves /metrics (the services: batch sizes, queue, waits) on the
    metrics port, annotated for Prometheus; the network policies open that port, and
    only that port, to scrapers."""
    docs = releases[case]
    deployments = objects(docs, "Deployment")
    policies = list(objects(docs, "NetworkPolicy").values())
    for name, deployment in every(deployments.items(), "deployments"):
        if name.endswith("-redis"):
            continue
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        flags = arguments(container)
        assert flags["metrics-port"] == "9100" and flags["metrics-address"] == "0.0.0.0"
        assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
        annotations = template["metadata"].get("annotations", {})
        annotated = case != "external-redis"  # its values turn the annotations off
        assert annotations.get("prometheus.io/port") == ("9100" if annotated else None)
        for policy in policies:
            if matches(policy["spec"]["podSelector"], template["metadata"]["labels"]):
                metrics_rules = [
                    rule
                    for rule in policy["spec"]["ingress"]
                    if rule["ports"] == [{"protocol": "TCP", "port": 9100}]
                ]
                assert len(metrics_rules) == 1, name
                scrapers = metrics_rules[0].get("from")  # absent: any source
                if case == "external-redis":
                    assert scrapers == [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                            }
                        }
                    ]
                else:
                    assert scrapers is None, name


def server_pods(docs: list[dict]) -> dict[str, dict]:
    """The pod specs of the Deployments of hydra-jury servers (not the bundled Redis)."""
    return {
        name: pod
        for name, pod in pod_specs(docs).items()
        if pod["containers"][0].get("args", [""])[0] in SERVERS
    }


@pytest.mark.parametrize("case", CASES)
def test_the_termination_grace_covers_the_pre_stop_sleep_and_the_drain(releases, case):
    values = {**DEFAULTS, **values_of(case)}
    grace, sleep = values["gracePeriodSeconds"], values["preStopSleepSeconds"]
    for name, pod in every(server_pods(releases[case]).items(), "server pods"):
        # The sleep, then --grace-s for the running generations, then 10 s for their last
        # rounds and the shutdown: the kubelet's SIGKILL comes after all of it.
        assert pod["terminationGracePeriodSeconds"] == sleep + grace + 10, name
    for server in every(servers(releases[case]), "servers"):
        assert arguments(server)["grace-s"] == str(grace)
        assert server["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(sleep)]}}}


def test_every_server_logs_in_the_log_format(releases, render):
    for server in every(servers(releases["defaults"]), "servers"):
        assert arguments(server)["log-format"] == "text"
    for server in every(servers(manifests(render(sets=("logFormat=json",)))), "servers"):
        assert arguments(server)["log-format"] == "json"


def test_no_pre_stop_sleep_renders_no_hook(render):
    docs = manifests(render(sets=("preStopSleepSeconds=0",)))
    for pod in every(server_pods(docs).values(), "server pods"):
        assert pod["terminationGracePeriodSeconds"] == DEFAULTS["gracePeriodSeconds"] + 10
    assert all("lifecycle" not in server for server in every(servers(docs), "servers"))


def test_the_orchestrator_gets_a_flag_per_request_limit(releases):
    (orchestrator,) = [
        c for c in servers(releases["drain-and-limits"]) if c["args"][0] == "orchestrator"
    ]
    limits = limits_from(orchestrator_parser().parse_args(orchestrator["args"][1:]))
    given = values_of("drain-and-limits")["orchestrator"]["limits"]
    snake = {name: re.sub(r"([A-Z])", lambda m: f"_{m[1].lower()}", name) for name in given}
    assert limits == RequestLimits(**{snake[name]: value for name, value in given.items()})
    defaults = [c for c in servers(releases["defaults"]) if c["args"][0] == "orchestrator"]
    assert not [arg for arg in defaults[0]["args"] if arg.startswith("--limit-")]


def test_orchestrators_pipeline_rounds_unless_told_not_to(releases):
    def pipelines(case: str) -> bool:
        (orchestrator,) = [c for c in servers(releases[case]) if c["args"][0] == "orchestrator"]
        return orchestrator_parser().parse_args(orchestrator["args"][1:]).pipeline_rounds

    assert pipelines("defaults") is True
    assert pipelines("drain-and-limits") is None  # the flag is left out: the default, off
