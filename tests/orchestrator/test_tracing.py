"""OpenTelemetry tracing across the services: the split stack as processes (`up`'s
launcher), every process exporting to a real OTLP/gRPC receiver on loopback. One
request is one trace: the orchestrator's server span continues the caller's
`traceparent`, its rounds hold the draft, score and accept spans, each internal call's
client span is the parent of the trunk's or a shard's server span, and each round's
commit to Redis is the round's. No span holds prompt or output text. The
single-process server (`serve`) traces its rounds too."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
import urllib.request
from typing import TextIO

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from hydra_jury.orchestrator.launcher import LocalStack, start_child
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.serving import tracing
from hydra_jury.serving.tls import open_channel
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

GRPC_TRACE, HTTP_TRACE, UNSAMPLED_TRACE = (f"{n:032x}" for n in (0xA1, 0xB2, 0xC3))
CALLER_SPAN = "00f067aa0ba902b7"
PROMPT = "zebra quartz"  # no span may hold it
SERVICES = {"hydra-jury-orchestrator", "hydra-jury-trunk", "hydra-jury-jury"}
GENERATE = "hydrajury.v1.Generation/Generate"
DRAFT, SCORE = "hydrajury.v1.Trunk/Draft", "hydrajury.v1.Jury/Score"
COMMIT = "session_store.commit"
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


def traceparent(trace_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{CALLER_SPAN}-{'01' if sampled else '00'}"


class Tee(io.StringIO):
    """Keeps what is written and passes it on."""

    def __init__(self, to: TextIO) -> None:
        super().__init__()
        self.to = to

    def write(self, text: str) -> int:
        self.to.write(text)
        return super().write(text)


@pytest.fixture(scope="module")
def traced(jury_checkpoint):
    """(every span the stack exported, by the time it stopped; the answers; the
    orchestrator's JSON log lines) for requests sent to a stack that exports the traces
    its callers sample, and no other (OTEL_TRACES_SAMPLER=parentbased_traceidratio,
    ratio 0)."""
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as environment:
        environment.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
        environment.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
        environment.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        forwarded = Tee(sys.stderr)  # the launcher forwards each process's lines here
        environment.setattr(sys, "stderr", forwarded)
        stack = LocalStack(
            str(jury_checkpoint),
            shards=2,
            port=0,
            shard_threads=1,
            http_listen="127.0.0.1:0",
            served_model_name="demo",
            log_format="json",
            otlp_endpoint=receiver.endpoint,
        )
        try:
            address = stack.start(timeout_s=120)
            answers = send_requests(address, stack.http_detail.split(" on ")[-1])
        finally:
            stack.stop()  # each process flushes its spans as it exits
        logged = re.findall(r"^\[orchestrator\] (\{.*)$", forwarded.getvalue(), re.M)
        return receiver.spans, answers, [json.loads(line) for line in logged]


def send_requests(address: str, url: str) -> dict:
    options = generation_pb2.DecodingOptions(
        max_new_tokens=12, seed=5, gamma=3, rule="exact", drafter="head", ignore_eos=True
    )
    request = generation_pb2.GenerateRequest(prompt=PROMPT, options=options, request_id="r-1")
    with open_channel(address, None) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        grpc_answer = stub.Generate(
            request, timeout=60, metadata=[("traceparent", traceparent(GRPC_TRACE))]
        )
        unsampled = stub.Generate(
            request, timeout=60, metadata=[("traceparent", traceparent(UNSAMPLED_TRACE, False))]
        )
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 6, "seed": 2}
    http_request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": traceparent(HTTP_TRACE)},
    )
    with urllib.request.urlopen(http_request, timeout=60) as answer:
        http_answer = json.load(answer)
    return {"grpc": grpc_answer, "unsampled": unsampled, "http": http_answer}


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.trace_id == trace_id]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str | None = None):
    return [s for s in spans if s.parent_id == parent.span_id and name in (None, s.name)]


def check_one_trace(
    spans: list[ReceivedSpan], root_name: str, service: str = "hydra-jury-orchestrator"
) -> ReceivedSpan:
    """The trace's root: the request's server span in `service`, the caller's span its
    parent; every other span's parent is in the trace. Returns the root."""
    (root,) = [s for s in spans if s.parent_id == CALLER_SPAN]
    assert root.name == root_name and root.span.kind == SERVER
    assert root.service == service
    ids = {span.span_id for span in spans}
    assert all(span.parent_id in ids for span in spans if span is not root)
    return root


def check_rounds(spans: list[ReceivedSpan], request_span: ReceivedSpan, rounds: int) -> None:
    """Each round: a draft span (the trunk's Draft call within), a score span (a Score
    call to each shard within), an accept span; and the rounds' commits to the session
    store (`check_commits`)."""
    round_spans = children(spans, request_span, "round")
    assert len(round_spans) == rounds
    assert sorted(s.attributes["hydra.index"] for s in round_spans) == list(range(rounds))
    for round_span in round_spans:
        assert {"draft", "score", "accept"} <= {s.name for s in children(spans, round_span)}
        (draft,) = children(spans, round_span, "draft")
        (score,) = children(spans, round_span, "score")
        assert [s.attributes["hydra.component"] for s in children(spans, draft, DRAFT)] == ["trunk"]
        shard_calls = children(spans, score, SCORE)
        assert sorted(s.attributes["hydra.component"] for s in shard_calls) == ["jury0", "jury1"]
        for call in [*children(spans, draft, DRAFT), *shard_calls]:
            assert call.span.kind == CLIENT and call.service == "hydra-jury-orchestrator"
            (served,) = children(spans, call)  # the service's server span
            assert served.name == call.name and served.span.kind == SERVER
            assert served.service == (
                "hydra-jury-trunk" if call.name == DRAFT else "hydra-jury-jury"
            )
            assert served.attributes["rpc.grpc.status_code"] == 0
            assert served.attributes["hydra.batch_size"] >= 1
    check_commits(spans, round_spans)


def check_commits(spans: list[ReceivedSpan], round_spans: list[ReceivedSpan]) -> None:
    """A commit runs in the span of the last round it stores (rounds computed while one
    is in flight, or within the commit interval, go with the next): together they store
    every round, and the last round has one."""
    commits = {s.attributes["hydra.index"]: children(spans, s, COMMIT) for s in round_spans}
    carried = [c.attributes["hydra.rounds"] for found in commits.values() for c in found]
    assert sum(carried) == len(round_spans) and all(n >= 1 for n in carried)
    assert len(commits[len(round_spans) - 1]) == 1


def texts(span: ReceivedSpan) -> list[str]:
    values = [*span.attributes.values(), *span.resource.values()]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [v for v in flat if isinstance(v, str)]


def test_one_generate_is_one_trace_across_the_three_services(traced):
    spans, answers, _logged = traced
    trace = of_trace(spans, GRPC_TRACE)
    assert {span.service for span in trace} == SERVICES
    # both shards: their resources name their heads
    shards = {s.resource["hydra.heads"] for s in trace if s.service == "hydra-jury-jury"}
    assert shards == {"head0,head2", "head1,head3"}
    root = check_one_trace(trace, GENERATE)
    answer = answers["grpc"]
    attributes = root.attributes
    assert attributes["rpc.grpc.status_code"] == 0 and attributes["hydra.status"] == "OK"
    assert attributes["hydra.request_id"] == "r-1"
    assert attributes["hydra.session_id"] == answer.session_id
    assert (attributes["hydra.rule"], attributes["hydra.gamma"]) == ("exact", 3)
    assert attributes["hydra.jury"] == list(answer.jury)
    assert attributes["hydra.draft_head"] == answer.draft_head
    assert attributes["hydra.generated_tokens"] == 12
    check_rounds(trace, root, answer.stats.rounds)
    drafted = sum(s.attributes["hydra.drafted"] for s in trace if s.name == "round")
    assert drafted == answer.stats.drafted
    # the session store's writes: the session's creation, the turn, then the rounds
    commits = [s for s in trace if s.name == COMMIT]
    assert sum(s.attributes["hydra.rounds"] for s in commits) == answer.stats.rounds


def test_the_http_api_continues_the_callers_trace(traced):
    spans, answers, _logged = traced
    trace = of_trace(spans, HTTP_TRACE)
    assert {span.service for span in trace} == SERVICES
    root = check_one_trace(trace, "POST /v1/completions")
    assert root.attributes["http.response.status_code"] == 200
    assert answers["http"]["usage"]["completion_tokens"] == 6
    assert children(trace, root, "round")


def test_a_trace_the_caller_did_not_sample_is_not_exported(traced):
    spans, _answers, _logged = traced
    assert of_trace(spans, UNSAMPLED_TRACE) == []
    # what was exported: the sampled requests' traces alone
    assert {span.trace_id for span in spans} == {GRPC_TRACE, HTTP_TRACE}


def test_no_span_holds_prompt_or_output_text(traced):
    spans, answers, _logged = traced
    outputs = [answers["grpc"].text, answers["http"]["choices"][0]["text"]]
    words = [word for text in [PROMPT, *outputs] for word in text.split() if len(word) > 3]
    assert words
    for span in spans:
        for value in texts(span):
            assert not any(word in value for word in words), (span.name, value)


def test_the_log_lines_carry_the_trace_ids(traced):
    """A request's line joins its trace, sampled or not."""
    _spans, _answers, logged = traced
    traces = {line["rpc"]: [] for line in logged if "rpc" in line}
    for line in logged:
        if "rpc" in line:
            traces[line["rpc"]].append(line["trace_id"])
    assert traces == {
        "Generate": [GRPC_TRACE, UNSAMPLED_TRACE],
        "/v1/completions": [HTTP_TRACE],
    }


def test_the_endpoint_is_the_flags_else_the_variables(monkeypatch):
    for name in (*tracing.ENDPOINT_VARIABLES, tracing.DISABLED_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    assert tracing.tracing_endpoint(None) is None  # off
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.tracing_endpoint(None) == "http://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces:4317")
    assert tracing.tracing_endpoint(None) == "https://traces:4317"  # the traces one first
    assert tracing.tracing_endpoint("http://mine:4317") == "http://mine:4317"
    monkeypatch.setenv(tracing.DISABLED_VARIABLE, "true")
    assert tracing.tracing_endpoint("http://mine:4317") is None


@pytest.mark.parametrize("bad", ["collector:4317", "grpc://collector:4317", "http://"])
def test_an_endpoint_that_is_no_url_is_refused_clearly(monkeypatch, bad):
    monkeypatch.delenv(tracing.DISABLED_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=re.escape(f"--otlp-endpoint: {bad!r} is not an OTLP")):
        tracing.tracing_endpoint(bad)


def test_the_service_name_is_the_roles_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.namespace=prod")
    resource = tracing.process_resource("hydra-jury-trunk", {"hydra.heads": "head0"})
    assert resource.attributes["service.name"] == "hydra-jury-trunk"
    assert resource.attributes["service.namespace"] == "prod"
    assert resource.attributes["hydra.heads"] == "head0"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trunk-eu")
    assert tracing.process_resource("hydra-jury-trunk").attributes["service.name"] == "trunk-eu"


def test_the_single_process_server_traces_its_rounds(jury_checkpoint):
    """`serve`: the rounds run on the model thread, and their spans still join the
    request's trace (the context follows the work across threads)."""
    with OtlpReceiver() as receiver:
        command = [sys.executable, "-m", "hydra_jury.cli", "serve", "--checkpoint"]
        command += [str(jury_checkpoint), "--listen", "127.0.0.1:0"]
        command += ["--max-session-tokens", "128", "--otlp-endpoint", receiver.endpoint]
        server = start_child("serve", command, 120)
        try:
            assert server.address, server.failure
            options = generation_pb2.DecodingOptions(
                max_new_tokens=6, seed=1, rule="exact", drafter="head", ignore_eos=True
            )
            request = generation_pb2.GenerateRequest(prompt=PROMPT, options=options)
            with open_channel(server.address, None) as channel:
                answer = generation_pb2_grpc.GenerationStub(channel).Generate(
                    request, timeout=60, metadata=[("traceparent", traceparent(GRPC_TRACE))]
                )
        finally:
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(30) == 0
        trace = of_trace(receiver.spans, GRPC_TRACE)
    assert {span.service for span in trace} == {"hydra-jury-server"}
    root = check_one_trace(trace, GENERATE, "hydra-jury-server")
    round_spans = children(trace, root, "round")
    assert len(round_spans) == answer.stats.rounds
    for round_span in round_spans:
        assert {"draft", "score", "accept"} <= {s.name for s in children(trace, round_span)}
    check_commits(trace, round_spans)
