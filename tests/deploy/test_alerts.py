"""The chart's alerts (`alerts.*`) run by Prometheus' own rule engine: the PrometheusRule
of a release with every alert on, its rules checked by `promtool check rules` and
evaluated by `promtool test rules` over input series shaped like the servers' metrics
(two orchestrator pods, the trunk and a shard): each alert fires where it should, with
its labels and annotations, and stays quiet on a healthy release, on too little traffic
and on another release's series. A poisoned head is told from the ordinary spread
between healthy heads by comparing it with the rest of the heads, computed exactly
(every head's sums less its own)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hydra_jury.serving.metrics import LATENCY_BUCKETS
from tests.deploy.conftest import manifests
from tests.deploy.test_helm_chart import PREFIX, objects

ALERT_LABELS = {"team": "ml"}  # alerts.alertLabels, on every alert
ORCHESTRATOR = {"namespace": "default", "job": f"{PREFIX}-orchestrator-metrics"}
PODS = [f"{PREFIX}-orchestrator-0", f"{PREFIX}-orchestrator-1"]
HEADS = ["head0", "head1", "head2", "head3"]
MINUTES = 60  # every input series: one sample a minute for an hour
EVAL = f"{MINUTES}m"


@pytest.fixture(scope="module")
def rules(render, tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The release's rules file (the PrometheusRule's spec) and its alerts by name."""
    sets = ["alerts.enabled=true"] + [
        f"alerts.alertLabels.{k}={v}" for k, v in ALERT_LABELS.items()
    ]
    (rule,) = objects(manifests(render(sets=tuple(sets))), "PrometheusRule").values()
    path = tmp_path_factory.mktemp("alerts") / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    return path, alerts


def series(name: str, values: str, **labels: str) -> dict:
    """An input series of promtool's: `values` in its expanding notation (`0+5x60`: from
    0, 5 more each minute, 60 times)."""
    matchers = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{matchers}}}", "values": values}


def counter(per_minute: float) -> str:
    return f"0+{per_minute}x{MINUTES}"


def per_pod(name: str, values: str, **labels: str) -> list[dict]:
    """The same series from every orchestrator pod (the alerts sum over them)."""
    return [series(name, values, **ORCHESTRATOR, pod=pod, **labels) for pod in PODS]


def expected(alert: dict, value: str | None = None, **labels: str) -> dict:
    """An alert as promtool reports it: its labels and its annotations, with Prometheus'
    templates filled in from `labels` and the alert's `value` as humanized."""
    known = {f"$labels.{key}": text for key, text in labels.items()}
    if value is not None:
        known |= {"$value | humanizePercentage": value, "$value | humanizeDuration": value}

    def fill(text: str) -> str:
        return re.sub(r"\{\{ (.+?) \}\}", lambda m: known[m[1]], text)

    return {
        "exp_labels": {**labels, **ALERT_LABELS, **alert["labels"]},
        "exp_annotations": {k: fill(v) for k, v in alert["annotations"].items()},
    }


def run_rule_tests(promtool: Path, rules, alert: str, inputs: list[dict], fired: list[dict]):
    """`promtool test rules` of one alert at the hour's end: `fired` is what it reports
    (empty: nothing fires)."""
    path, _ = rules
    test = path.with_name(f"test-{alert}.yaml")
    test.write_text(
        yaml.safe_dump(
            {
                "rule_files": [path.name],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": inputs,
                        "alert_rule_test": [
                            {"eval_time": EVAL, "alertname": alert, "exp_alerts": fired}
                        ],
                    }
                ],
            }
        )
    )
    result = subprocess.run(
        [str(promtool), "test", "rules", str(test)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_are_valid_and_cover_every_alert(promtool, rules):
    path, alerts = rules
    result = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(alerts) == {
        "HydraJuryNoReadyReplica",
        "HydraJurySessionStoreDown",
        "HydraJuryErrorRatio",
        "HydraJuryTimeToFirstToken",
        "HydraJuryQueueWait",
        "HydraJuryHeadAcceptanceDrop",
        "HydraJuryJurorDissent",
    }
    for alert in alerts.values():
        assert alert["labels"]["team"] == "ml" and alert["labels"]["severity"]
        assert {"summary", "description"} <= set(alert["annotations"])


# --- a drifted or poisoned head -------------------------------------------------------


def per_head(
    whole: str, part: str, parts_of_60: dict[str, float], per_minute: dict[str, float]
) -> list[dict]:
    """Each head's counter `whole` per minute and pod (`per_minute[head]`, else 60) and
    the counter `part` of it, `parts_of_60[head]` per 60."""
    inputs = []
    for head, part_of_60 in parts_of_60.items():
        total = per_minute.get(head, 60)
        inputs += per_pod(whole, counter(total), head=head)
        inputs += per_pod(part, counter(part_of_60 * total / 60), head=head)
    return inputs


def drafts(kept_of_60: dict[str, float], drafted: dict[str, float] | None = None) -> list[dict]:
    """Each head's drafts per minute and pod (60 unless `drafted` says) and of which the
    jury kept `kept_of_60[head]` per 60."""
    return per_head(
        "hydrajury_head_draft_tokens_total",
        "hydrajury_head_accepted_tokens_total",
        kept_of_60,
        drafted or {},
    )


def test_a_head_whose_drafts_the_jury_rejects_fires(promtool, rules):
    alert = rules[1]["HydraJuryHeadAcceptanceDrop"]
    inputs = drafts({"head0": 45, "head1": 42, "head2": 9, "head3": 48})
    fired = [expected(alert, "15%", head="head2")]
    run_rule_tests(promtool, rules, "HydraJuryHeadAcceptanceDrop", inputs, fired)


def test_healthy_heads_with_an_ordinary_spread_do_not_fire(promtool, rules):
    inputs = drafts({"head0": 48, "head1": 39, "head2": 33, "head3": 43})  # 55% to 80%
    run_rule_tests(promtool, rules, "HydraJuryHeadAcceptanceDrop", inputs, [])


def test_a_poisoned_head_that_drafts_most_tokens_still_fires(promtool, rules):
    """Against all the heads' acceptance, its own included, head2 (10 of 12 draft tokens,
    10% kept) would be only 15 points below (25%, under the 20-point margin): the rest of
    the heads' is 75%."""
    alert = rules[1]["HydraJuryHeadAcceptanceDrop"]
    inputs = drafts({"head0": 45, "head2": 6, "head3": 45}, drafted={"head2": 600})
    fired = [expected(alert, "10%", head="head2")]
    run_rule_tests(promtool, rules, "HydraJuryHeadAcceptanceDrop", inputs, fired)


def test_a_quiet_head_never_fires(promtool, rules):
    """head2 drafted 4 tokens a minute (240 in the 30-minute window, under 500), none kept."""
    inputs = drafts({"head0": 45, "head1": 45, "head2": 0}, drafted={"head2": 2})
    run_rule_tests(promtool, rules, "HydraJuryHeadAcceptanceDrop", inputs, [])


def test_another_releases_poisoned_head_is_not_this_releases(promtool, rules):
    inputs = [
        {**s, "series": s["series"].replace(f'job="{PREFIX}-', 'job="other-hydra-jury-')}
        for s in drafts({"head0": 45, "head1": 42, "head2": 9, "head3": 48})
    ]
    run_rule_tests(promtool, rules, "HydraJuryHeadAcceptanceDrop", inputs, [])


def votes(dissents_of_60: dict[str, float], per_minute: float = 60) -> list[dict]:
    """Each juror's votes per minute and pod, and of which `dissents_of_60[head]` per 60
    were for another token than the emitted one."""
    return per_head(
        "hydrajury_juror_votes_total",
        "hydrajury_juror_dissents_total",
        dissents_of_60,
        dict.fromkeys(dissents_of_60, per_minute),
    )


def test_a_juror_that_dissents_far_more_than_the_rest_fires(promtool, rules):
    alert = rules[1]["HydraJuryJurorDissent"]
    inputs = votes({"head0": 3, "head1": 2, "head2": 30, "head3": 4})
    fired = [expected(alert, "50%", head="head2")]
    run_rule_tests(promtool, rules, "HydraJuryJurorDissent", inputs, fired)


def test_jurors_with_an_ordinary_spread_do_not_fire(promtool, rules):
    """head2 dissents 13%, over twice the rest's 6%, but within the 10-point margin."""
    inputs = votes({"head0": 2, "head1": 5, "head2": 8, "head3": 4})
    run_rule_tests(promtool, rules, "HydraJuryJurorDissent", inputs, [])


def test_jurors_with_few_votes_never_fire(promtool, rules):
    inputs = votes({"head0": 3, "head1": 2, "head2": 30, "head3": 4}, per_minute=4)
    run_rule_tests(promtool, rules, "HydraJuryJurorDissent", inputs, [])


# --- availability ---------------------------------------------------------------------


def ready(component: str, *per_pod_values: str) -> list[dict]:
    return [
        series("hydrajury_ready_replicas", values, **ORCHESTRATOR, pod=pod, component=component)
        for pod, values in zip(PODS, per_pod_values, strict=True)
    ]


def test_a_shard_without_ready_replicas_fires(promtool, rules):
    alert = rules[1]["HydraJuryNoReadyReplica"]
    inputs = ready("trunk", "2x60", "2x60") + ready("jury0", "1x60", "1x60")
    inputs += ready("jury1", "1x40 0x20", "1x40 0x20")  # gone 20 minutes ago
    fired = [expected(alert, component="jury1")]
    run_rule_tests(promtool, rules, "HydraJuryNoReadyReplica", inputs, fired)


def test_no_ready_replica_waits_for_its_duration_and_for_every_orchestrator(promtool, rules):
    """Gone one minute ago (under `for: 2m`); or seen by one orchestrator only."""
    inputs = ready("jury1", "1x59 0", "1x59 0") + ready("jury0", "1x60", "1x40 0x20")
    run_rule_tests(promtool, rules, "HydraJuryNoReadyReplica", inputs, [])


def test_an_orchestrator_without_its_session_store_fires(promtool, rules):
    alert = rules[1]["HydraJurySessionStoreDown"]
    inputs = [
        series("hydrajury_session_store_up", "1x60", **ORCHESTRATOR, pod=PODS[0]),
        series("hydrajury_session_store_up", "1x50 0x10", **ORCHESTRATOR, pod=PODS[1]),
    ]
    fired = [expected(alert, **ORCHESTRATOR, pod=PODS[1])]
    run_rule_tests(promtool, rules, "HydraJurySessionStoreDown", inputs, fired)


# --- errors and latency ---------------------------------------------------------------


def calls(per_minute: float, errors: dict[str, float]) -> list[dict]:
    """Calls per minute and pod, and of which failed with each status code."""
    inputs = per_pod("hydrajury_requests_total", counter(per_minute), rpc="GenerateStream")
    for code, failed in errors.items():
        inputs += per_pod("hydrajury_errors_total", counter(failed), code=code)
    return inputs


def test_server_faults_past_the_threshold_fire(promtool, rules):
    alert = rules[1]["HydraJuryErrorRatio"]
    inputs = calls(100, {"INTERNAL": 4, "UNAVAILABLE": 3.5, "INVALID_ARGUMENT": 20})
    fired = [expected(alert, "7.5%")]
    run_rule_tests(promtool, rules, "HydraJuryErrorRatio", inputs, fired)


def test_the_callers_own_errors_do_not_count(promtool, rules):
    client_codes = ["INVALID_ARGUMENT", "CANCELLED", "NOT_FOUND", "ALREADY_EXISTS", "ABORTED"]
    client_codes += ["UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"]
    client_codes += ["DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "OUT_OF_RANGE"]
    inputs = calls(100, {code: 5 for code in client_codes} | {"INTERNAL": 1})
    run_rule_tests(promtool, rules, "HydraJuryErrorRatio", inputs, [])


def test_too_few_calls_never_fire(promtool, rules):
    """Half the calls fail, but the two pods take 2 calls a minute: 10 in the 5-minute
    window, under the 20 the ratio needs."""
    inputs = calls(1, {"INTERNAL": 0.5})
    run_rule_tests(promtool, rules, "HydraJuryErrorRatio", inputs, [])


def histogram(name: str, seconds: float, per_minute: float, **labels: str) -> list[dict]:
    """A latency histogram (the servers' LATENCY_BUCKETS) whose every observation falls
    in the bucket holding `seconds`."""
    inputs = []
    for bound in [*LATENCY_BUCKETS, float("inf")]:
        le = "+Inf" if bound == float("inf") else str(float(bound))
        inputs.append(
            series(
                f"{name}_bucket", counter(per_minute if seconds <= bound else 0), le=le, **labels
            )
        )
    return inputs


def test_a_slow_first_token_fires(promtool, rules):
    """Every first token in the (5 s, 10 s] bucket: p95 interpolates to 9.75 s."""
    alert = rules[1]["HydraJuryTimeToFirstToken"]
    name = "hydrajury_time_to_first_token_seconds"
    inputs = [s for pod in PODS for s in histogram(name, 7, 10, **ORCHESTRATOR, pod=pod)]
    run_rule_tests(promtool, rules, "HydraJuryTimeToFirstToken", inputs, [expected(alert, "9.75s")])
    fast = [s for pod in PODS for s in histogram(name, 0.3, 10, **ORCHESTRATOR, pod=pod)]
    run_rule_tests(promtool, rules, "HydraJuryTimeToFirstToken", fast, [])


def test_a_long_queue_wait_fires_for_its_service_and_rpc(promtool, rules):
    """The trunk's Draft calls wait 1 to 2.5 s (p95 2.425 s); a shard's Score calls do not."""
    alert = rules[1]["HydraJuryQueueWait"]
    name = "hydrajury_queue_wait_seconds"
    trunk = {"namespace": "default", "job": f"{PREFIX}-trunk-metrics", "pod": f"{PREFIX}-trunk-0"}
    shard = {"namespace": "default", "job": f"{PREFIX}-jury-a-metrics", "pod": f"{PREFIX}-jury-a-0"}
    inputs = histogram(name, 2, 30, **trunk, rpc="Draft") + histogram(
        name, 0.002, 30, **trunk, rpc="Prefill"
    )
    inputs += histogram(name, 0.02, 60, **shard, rpc="Score")
    fired = [expected(alert, "2.425s", job=trunk["job"], rpc="Draft")]
    run_rule_tests(promtool, rules, "HydraJuryQueueWait", inputs, fired)
