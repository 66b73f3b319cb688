"""Every metric the chart's dashboard and alerts query is one the real servers export: a
split stack (trunk service, two jury shards, orchestrator; tests/grpc_stack.py) runs a
generation with a draft head, then each server's /metrics is read and parsed, and every
`hydrajury_*` name in the dashboard's queries and the alerts' expressions must be
declared by some server, as a family of the right type (a `_bucket` name belongs to a
histogram). A renamed metric, or a query of one that no server has, fails here rather
than as an empty panel or an alert that can never fire."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hydra_jury.protos.hydrajury.v1 import generation_pb2
from tests.deploy.conftest import CHART, manifests
from tests.deploy.test_helm_chart import objects
from tests.grpc_stack import Stack

METRIC = re.compile(r"hydrajury_[a-z_]+")
# The names a family's samples have, by its type (the exposition format's suffixes).
SAMPLES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}


@pytest.fixture(scope="module")
def exported(jury_checkpoint, redis_url) -> dict[str, set[str]]:
    """Each server → the sample names it declares, after one generation drafted by a
    head (so that the per-head and per-position families have samples too, not only
    their declarations)."""
    stack = Stack(
        str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url, metrics=True
    )
    try:
        stack.start_services().start_orchestrator(metrics_port=0)
        options = generation_pb2.DecodingOptions(
            max_new_tokens=12, seed=5, rule="exact", drafter="head", gamma=3, ignore_eos=True
        )
        request = generation_pb2.GenerateRequest(prompt="the cat", options=options)
        response = stack.generation().Generate(request, timeout=60)
        assert response.stats.rounds > 0 and response.draft_head
        names = {}
        for server, port in stack.metrics_ports.items():
            names[server] = set()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                text = page.read().decode()
            for family in text_string_to_metric_families(text):
                # The parser names a counter's family without its `_total`.
                names[server] |= {family.name + suffix for suffix in SAMPLES[family.type]}
        yield names
    finally:
        stack.close()


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "hydra-jury.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = dashboard["templating"]["list"]
    return exprs + [v["query"]["query"] for v in variables if v["type"] == "query"]


@pytest.fixture(scope="module")
def alert_expressions(render) -> list[str]:
    (rule,) = objects(manifests(render(sets=("alerts.enabled=true",))), "PrometheusRule").values()
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def test_every_server_serves_its_metrics(exported):
    assert set(exported) == {"orchestrator", "trunk", "jury0", "jury1"}
    for service in ("trunk", "jury0", "jury1"):
        assert "hydrajury_queue_wait_seconds_bucket" in exported[service]
        assert "hydrajury_tokens_emitted_total" not in exported[service]
    assert "hydrajury_tokens_emitted_total" in exported["orchestrator"]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_queried_metric_is_exported(exported, alert_expressions, source):
    queries = dashboard_queries() if source == "dashboard" else alert_expressions
    queried = {name for query in queries for name in METRIC.findall(query)}
    assert len(queried) >= (10 if source == "dashboard" else 8), queried
    missing = sorted(queried - set().union(*exported.values()))
    assert not missing, f"the {source} queries metrics no server exports: {missing}"
