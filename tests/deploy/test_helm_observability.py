"""The chart's observability values: the Grafana dashboard (`grafana.dashboards`) in a
ConfigMap for Grafana's sidecar, the alerts' PrometheusRule (`alerts`; what its rules
do: test_alerts.py) and the OpenTelemetry variables of every server (`tracing`). All
off by default; `ci/observability-values.yaml` turns them on, and its manifests are
validated strictly and linted with the other cases' (test_helm_chart.py). Here: what
they hold, the dashboard's queries parsed by promtool, and bad values refused."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from tests.deploy.conftest import CHART, manifests, refusal
from tests.deploy.test_helm_chart import PREFIX, objects, pod_specs, servers

OBSERVABILITY = CHART / "ci" / "observability-values.yaml"
DASHBOARD_FILE = CHART / "dashboards" / "hydra-jury.json"
DASHBOARD = f"{PREFIX}-dashboard"
# What an operator looks for on the dashboard, by panel title.
PANELS = {
    "Throughput",
    "Time to first token",
    "Time per output token",
    "Errors by status code",
    "Sessions",
    "Acceptance",
    "Acceptance per draft position",
    "Acceptance per draft head",
    "Juror dissent per head",
    "Queue wait p95",
    "Mean batch size",
    "Refused calls by reason",
    "Session store (Redis)",
    "Ready replicas per component",
}
# Grafana's variables, as a Prometheus query would see them once Grafana filled them in.
GRAFANA_VARIABLES = {"$namespace": "default", "$job": ".+", "$__rate_interval": "1m"}


@pytest.fixture(scope="module")
def observed(render) -> list[dict]:
    return manifests(render(OBSERVABILITY))


@pytest.fixture(scope="module")
def defaults(render) -> list[dict]:
    return manifests(render())


def dashboard_json() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def panels(dashboard: dict) -> list[dict]:
    """The dashboard's panels, not its rows."""
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def queries(dashboard: dict) -> list[str]:
    """Every PromQL query of the dashboard: its panels' and its variables'."""
    exprs = [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]
    variables = dashboard["templating"]["list"]
    return exprs + [v["query"]["query"] for v in variables if v["type"] == "query"]


def test_nothing_of_it_by_default(defaults):
    assert DASHBOARD not in objects(defaults, "ConfigMap")
    assert not objects(defaults, "PrometheusRule")
    for container in servers(defaults):
        names = [variable["name"] for variable in container.get("env", [])]
        assert not [name for name in names if name.startswith("OTEL_") or name == "POD_NAME"]


def test_the_dashboard_configmap_is_labelled_for_grafanas_sidecar(observed):
    configmap = objects(observed, "ConfigMap")[DASHBOARD]
    metadata = configmap["metadata"]
    assert metadata["labels"]["grafana_dashboard"] == "1"
    assert metadata["annotations"] == {"grafana_folder": "hydra-jury"}
    assert "namespace" not in metadata  # the release's
    (name,) = configmap["data"]
    assert name.endswith(".json")  # the sidecar's file name in Grafana
    assert json.loads(configmap["data"][name]) == dashboard_json()


def test_the_sidecars_label_and_namespace_are_values(render):
    sets = (
        "grafana.dashboards.enabled=true",
        "grafana.dashboards.label=dashboards",
        "grafana.dashboards.labelValue=hydra",
        "grafana.dashboards.namespace=monitoring",
    )
    metadata = objects(manifests(render(sets=sets)), "ConfigMap")[DASHBOARD]["metadata"]
    assert (
        metadata["labels"]["dashboards"] == "hydra"
        and "grafana_dashboard" not in (metadata["labels"])
    )
    assert metadata["namespace"] == "monitoring"


def test_the_dashboard_has_its_panels_on_the_datasource_variable():
    dashboard = dashboard_json()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= set(variables)
    assert {panel["title"] for panel in panels(dashboard)} >= PANELS
    source = {"type": "prometheus", "uid": "${datasource}"}
    for variable in variables.values():
        assert variable.get("datasource", source) == source, variable["name"]
    for panel in panels(dashboard):
        assert panel["datasource"] == source, panel["title"]
        assert panel["description"], panel["title"]
        for target in every_target(panel):
            assert target["datasource"] == source
            # Every query is scoped to the chosen namespace and jobs.
            assert 'namespace="$namespace", job=~"$job"' in target["expr"], target["expr"]


def every_target(panel: dict) -> list[dict]:
    assert panel["targets"], f"{panel['title']} has no query"
    return panel["targets"]


def test_the_dashboards_panels_tile_the_grid():
    ids, cells = set(), set()
    for panel in dashboard_json()["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered


def test_the_dashboards_queries_are_promql(promtool, tmp_path):
    """promtool parses each query (Grafana's variables filled in) as a recording rule."""
    dashboard_queries = queries(dashboard_json())
    filled = []
    for query in dashboard_queries:
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, query
        # label_values() is Grafana's, around a series selector.
        filled.append(re.sub(r"^label_values\((.+), \w+\)$", r"\1", query))
    rules = [{"record": f"dashboard:query{i}", "expr": q} for i, q in enumerate(filled)]
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(dashboard_queries)} rules found" in result.stdout


def test_the_alerts_prometheusrule(observed):
    (rule,) = objects(observed, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"  # alerts.labels
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert len(alerts) == 7
    assert alerts["HydraJuryHeadAcceptanceDrop"]["labels"] == {
        "severity": "critical",
        "team": "ml-serving",
    }
    assert alerts["HydraJuryQueueWait"]["labels"] == {"severity": "warning", "team": "ml-serving"}
    # Scoped to this release: its namespace and its ServiceMonitors' jobs.
    selector = f'namespace="default",job=~"{PREFIX}-.+-metrics"'
    for alert in alerts.values():
        selectors = re.findall(r"hydrajury_\w+\{([^}]*)\}", alert["expr"])
        assert selectors, alert["alert"]
        assert all(s.startswith(selector) for s in selectors), alert["expr"]
    # The orchestrators' names for the trunk and the shards, in the no-ready-replica alert.
    description = alerts["HydraJuryNoReadyReplica"]["annotations"]["description"]
    assert f"jury1 = {PREFIX}-jury-b" in description


def test_an_alert_can_be_turned_off_and_the_selector_replaced(render):
    sets = (
        "alerts.enabled=true",
        "alerts.jurorDissent.enabled=false",
        "alerts.errorRatio.window=15m",
        'alerts.selector=kubernetes_namespace="hydra"',
    )
    (rule,) = objects(manifests(render(sets=sets)), "PrometheusRule").values()
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert "HydraJuryJurorDissent" not in alerts and len(alerts) == 6
    assert "[15m]" in alerts["HydraJuryErrorRatio"]["expr"]
    for alert in alerts.values():
        assert "job=~" not in alert["expr"] and 'kubernetes_namespace="hydra"' in alert["expr"]


def tracing_env(container: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in container.get("env", [])}


SERVICE_NAMES = {
    f"{PREFIX}-orchestrator": ("hydra-jury-orchestrator", ""),
    f"{PREFIX}-trunk": ("hydra-jury-trunk", ""),
    f"{PREFIX}-jury-a": ("hydra-jury-jury", ",hydra.shard=a"),
    f"{PREFIX}-jury-b": ("hydra-jury-jury", ",hydra.shard=b"),
}


def test_every_server_gets_the_opentelemetry_variables(observed):
    pods = pod_specs(observed)
    for deployment, (service, shard) in SERVICE_NAMES.items():
        (container,) = pods[deployment]["containers"]
        env = tracing_env(container)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == (
            "http://otel-collector.observability:4317"
        )
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
        assert env["OTEL_SERVICE_NAME"]["value"] == service
        assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == (
            f"service.namespace=default,k8s.pod.name=$(POD_NAME){shard}"
        )
        # The pod's name from the downward API, declared before the variable that
        # Kubernetes expands it into.
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        names = list(env)
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_the_sampler_argument_is_left_out_unless_given(render):
    docs = manifests(render(sets=("tracing.otlpEndpoint=https://otel.example:4318",)))
    for container in servers(docs):
        env = tracing_env(container)
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_always_on"
        assert "OTEL_TRACES_SAMPLER_ARG" not in env
    # The orchestrator's own variables stay.
    (orchestrator,) = pod_specs(docs)[f"{PREFIX}-orchestrator"]["containers"]
    assert {"OMP_NUM_THREADS", "HYDRA_JURY_REDIS_URL"} <= set(tracing_env(orchestrator))


INVALID = {
    "an endpoint without a scheme": (
        {"tracing": {"otlpEndpoint": "otel-collector:4317"}},
        "tracing.otlpEndpoint: Does not match pattern",
    ),
    "an endpoint with credentials": (
        {"tracing": {"otlpEndpoint": "https://user:secret@otel:4318"}},
        "tracing.otlpEndpoint: Does not match pattern",
    ),
    "an unknown sampler": (
        {"tracing": {"sampler": "sometimes"}},
        "tracing.sampler: tracing.sampler must be one of the following",
    ),
    "a sampler ratio above 1": (
        {"tracing": {"samplerArg": "1.5"}},
        "tracing.samplerArg: Does not match pattern",
    ),
    "a mistyped tracing value": (
        {"tracing": {"endpoint": "http://otel:4317"}},
        "Additional property endpoint is not allowed",
    ),
    "a dashboard label that is no label": (
        {"grafana": {"dashboards": {"label": "grafana dashboard"}}},
        "grafana.dashboards.label: Does not match pattern",
    ),
    "a duration Prometheus cannot read": (
        {"alerts": {"headAcceptance": {"for": "15 minutes"}}},
        "alerts.headAcceptance.for: Does not match pattern",
    ),
    "an error ratio above 1": (
        {"alerts": {"errorRatio": {"threshold": 5}}},
        "alerts.errorRatio.threshold: Must be less than or equal to 1",
    ),
    "an unknown status code": (
        {"alerts": {"errorRatio": {"codes": ["INTERNAL", "BROKEN"]}}},
        "alerts.errorRatio.codes.1: alerts.errorRatio.codes.1 must be one of the following",
    ),
    "an unknown alert": (
        {"alerts": {"headDrift": {"enabled": True}}},
        "Additional property headDrift is not allowed",
    ),
    "a dissent ratio below 1": (
        {"alerts": {"jurorDissent": {"ratio": 0.5}}},
        "alerts.jurorDissent.ratio: Must be greater than or equal to 1",
    ),
    "a selector with braces": (
        {"alerts": {"selector": '{namespace="hydra"}'}},
        "alerts.selector: Does not match pattern",
    ),
}


@pytest.mark.parametrize("problem", INVALID)
def test_invalid_values_are_refused(render, tmp_path, problem):
    values, message = INVALID[problem]
    assert message in refusal(render, tmp_path, values)
