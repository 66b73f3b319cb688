"""The orchestrator over gRPC: the same tokens as in-process, streaming, cancellation,
status codes, health, reflection, layout checks and metrics."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from hydra_jury.orchestrator.auto import CostModel
from hydra_jury.orchestrator.grpc_backend import GrpcBackend
from hydra_jury.orchestrator.layout import LayoutError
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving import internal_wire as wire
from hydra_jury.workers.errors import InvalidArgument
from tests.grpc_stack import Stack, retry_busy, wait_for
from tests.orchestrator.test_auto import use_costs

ALL_HEADS = ["head0", "head1", "head2", "head3"]
CONTRASTIVE = {"contrastive_alpha": 0.1, "contrastive_amateur": "head3"}
# Fixed drafters: the round structure (and so the statistics) must match too. The
# automatic mode's choices follow each process's timings; its tokens are compared below.
CASES = [
    {"rule": "exact", "temperature": 0.0, "gamma": 3, "drafter": "head"},
    {
        "rule": "exact",
        "temperature": 0.9,
        "gamma": 4,
        "top_k": 10,
        "epsilon": 0.02,
        "drafter": "head",
    },
    {
        "rule": "cascade_token_v2",
        "lenience": 0.2,
        "temperature": 1.0,
        "gamma": 2,
        "drafter": "head",
    },
    {"rule": "lenient", "lenience": 0.3, "temperature": 0.7, "gamma": 5, "drafter": "head"},
    {"rule": "verifier_only", "temperature": 0.8},
    # contrastive decoding: the amateur on one shard, some jurors on the other
    {"rule": "verifier_only", "temperature": 0.0, **CONTRASTIVE},
    {"rule": "verifier_only", "temperature": 0.7, **CONTRASTIVE},
    # prompt-lookup drafts checked in one pass (trunk forward, then every shard)
    {"rule": "exact", "temperature": 0.0, "gamma": 4, "drafter": "ngram"},
    {"rule": "cascade_chow", "lenience": 0.3, "temperature": 0.9, "gamma": 3, "drafter": "ngram"},
    # the trunk's draft model: it drafts and runs the trunk in one call, every shard checks
    {"rule": "exact", "temperature": 0.0, "gamma": 4, "drafter": "model"},
    {"rule": "exact", "temperature": 0.9, "gamma": 3, "top_p": 0.9, "drafter": "model"},
    {
        "rule": "cascade_token_v2",
        "lenience": 0.2,
        "temperature": 1.0,
        "gamma": 2,
        "drafter": "model",
    },
]


@pytest.fixture(
    scope="module",
    params=[[ALL_HEADS], [["head0", "head1"], ["head2", "head3"]], "embedded"],
    ids=["one-shard", "two-shards", "single-process"],
)
def stack(request, jury_checkpoint, draft_checkpoint, redis_url):
    """The Generation API: the split stack with one or two jury shards, or the
    single-process server, each with a draft model; every test of this module runs on
    each."""
    draft_model = str(draft_checkpoint)
    if request.param == "embedded":
        stack = Stack(str(jury_checkpoint), [], redis_url, draft_model=draft_model)
        stack.start_embedded(metrics_port=0)
    else:
        stack = Stack(str(jury_checkpoint), request.param, redis_url, draft_model=draft_model)
        stack.start_services().start_orchestrator(metrics_port=0)
    yield stack
    stack.close()


def to_pb(prompt: str, **options) -> generation_pb2.GenerateRequest:
    options.setdefault("max_new_tokens", 8)
    return generation_pb2.GenerateRequest(
        prompt=prompt, options=generation_pb2.DecodingOptions(**options)
    )


@pytest.mark.parametrize("case", CASES, ids=[c["rule"] + str(c["temperature"]) for c in CASES])
def test_grpc_gives_the_in_process_tokens(stack, model_engine, case):
    engine = model_engine  # the same checkpoint and draft model, in-process
    options = {"max_new_tokens": 24, "seed": 11, "ignore_eos": True, **case}
    expected = engine.generate(GenerationRequest(prompt="the cat", **options))
    response = stack.generation().Generate(to_pb("the cat", **options), timeout=30)
    assert list(response.token_ids) == expected.token_ids
    assert response.text == expected.text
    assert response.draft_head == (expected.draft_head or "")
    assert response.stats.rounds == expected.stats["rounds"]
    assert response.stats.accepted == expected.stats["accepted"]
    first = response.tokens[0]
    assert first.token_id == expected.tokens[0].token_id
    assert first.entropy == pytest.approx(expected.tokens[0].entropy, abs=1e-5)
    assert dict(first.votes) == expected.tokens[0].votes


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_automatic_mode_gives_the_non_speculative_tokens_over_grpc(stack, engine, temperature):
    """With a draft model on the trunk the automatic mode has every drafter to choose
    from; the tokens stay non-speculative PoE's. The server's costs start afresh, as on
    a new server: its second automatic round measures the draft model, whatever the
    rounds of this module's earlier requests measured (and a loaded machine made them
    cost) and however long since it last measured one."""
    use_costs(stack.servicer.runner.engine, CostModel())
    options = {"max_new_tokens": 24, "seed": 11, "ignore_eos": True, "temperature": temperature}
    expected = engine.generate(
        GenerationRequest(prompt="abcabcab", rule="verifier_only", **options)
    )
    response = stack.generation().Generate(to_pb("abcabcab", **options), timeout=30)
    assert list(response.token_ids) == expected.token_ids
    assert sum(response.stats.rounds_by_drafter.values()) == response.stats.rounds
    assert response.stats.rounds_by_drafter["model"] > 0
    assert set(response.stats.auto_inputs) >= {
        "ngram1_acceptance",
        "ngram3_acceptance",
        "model_acceptance",
        "plain_step_s",
        "model_round_4_s",
    }


def test_stream_delivers_the_unary_tokens_one_message_per_round(stack):
    request = to_pb("hi", max_new_tokens=20, seed=3, gamma=3, ignore_eos=True, drafter="head")
    generation = stack.generation()
    unary = generation.Generate(request, timeout=30)
    messages = list(generation.GenerateStream(request, timeout=30))
    assert [t.token_id for m in messages for t in m.tokens] == list(unary.token_ids)
    assert [m.round for m in messages] == list(range(len(messages)))
    assert len(messages) == unary.stats.rounds
    assert "".join(m.text for m in messages) == unary.text
    assert [m.finish_reason for m in messages[:-1]] == [""] * (len(messages) - 1)
    assert messages[-1].finish_reason == "length" and messages[-1].stats.rounds == len(messages)
    assert messages[-1].seed == 3


def test_cancelling_a_stream_gives_the_session_back_and_keeps_its_caches(stack):
    """A cancelled stream stops between rounds and releases its lease: the session takes
    its next request at once, reusing the caches; CloseSession frees them everywhere."""
    generation = stack.generation()
    stream = generation.GenerateStream(
        to_pb("hi", max_new_tokens=100, seed=1, gamma=1, ignore_eos=True), timeout=30
    )
    session_id = next(stream).session_id
    held = {n: stack.active_sessions(n) for n in stack.holders}
    stream.cancel()
    request = to_pb(" again", max_new_tokens=2, seed=1, ignore_eos=True, temperature=0.0)
    request.session_id = session_id
    again = retry_busy(lambda: generation.Generate(request, timeout=30))
    assert again.stats.reused_tokens > 0
    assert {n: stack.active_sessions(n) for n in stack.holders} == held
    generation.CloseSession(generation_pb2.CloseSessionRequest(session_id=session_id), timeout=5)
    assert wait_for(lambda: all(stack.active_sessions(n) == held[n] - 1 for n in stack.holders))


@pytest.mark.parametrize(
    ("request_pb", "message"),
    [
        (to_pb(""), "prompt is empty"),
        (generation_pb2.GenerateRequest(), "give exactly one of prompt and messages"),
        (to_pb("hi", rule="best"), "unknown rule 'best'"),
        (to_pb("hi", gamma=17), "gamma"),
        (to_pb("hi", temperature=-1.0), "temperature"),
        (to_pb("hi", draft_head="head7"), "unknown draft head 'head7'"),
        (to_pb("hi", jury=["head9"]), "unknown jury heads"),
        (to_pb("a" * 200), "over the context limit of 128"),
    ],
)
def test_bad_requests_are_invalid_argument(stack, request_pb, message):
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(request_pb, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()


def test_a_refused_internal_call_is_internal_for_the_client(stack, monkeypatch):
    """The loop checks requests before calling the workers, so a worker's refusal (an
    internal service's INVALID_ARGUMENT) is the loop's bug: INTERNAL, never "your
    argument"."""
    if stack.embedded:

        def refuse(calls):
            raise InvalidArgument("beta: must be in (0, 100], got 0.0")

        monkeypatch.setattr(stack.servicer.backend.jury, "score_batch", refuse)
    else:
        original = wire.score_call_to_pb

        def corrupted(call):
            message = original(call)
            message.beta = 0.0
            return message

        monkeypatch.setattr(wire, "score_call_to_pb", corrupted)
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(to_pb("hi", max_new_tokens=4, seed=1), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert "refused a call: beta: must be in (0, 100]" in raised.value.details()


def test_too_many_sessions_is_resource_exhausted(jury_checkpoint, redis_url):
    stack = Stack(
        str(jury_checkpoint), [ALL_HEADS], redis_url, max_sessions=1, reclaim_after_s=60
    ).start_services()
    try:
        stack.start_orchestrator()
        generation = stack.generation()
        first = generation.GenerateStream(
            to_pb("hi", max_new_tokens=100, gamma=1, seed=1, ignore_eos=True), timeout=30
        )
        next(first)
        with pytest.raises(grpc.RpcError) as raised:
            generation.Generate(to_pb("hi", max_new_tokens=5), timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "sessions are in use" in raised.value.details()
        first.cancel()
    finally:
        stack.close()


def test_health_and_reflection(stack):
    health = health_pb2_grpc.HealthStub(stack.channel("orchestrator"))
    for service in ("", "hydrajury.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel("orchestrator"))
    answers = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"hydrajury.v1.Generation", "grpc.health.v1.Health"} <= names


def test_info_and_metrics(stack):
    info = stack.generation().Info(generation_pb2.GenerationInfoRequest(), timeout=5)
    assert list(info.heads) == ALL_HEADS and info.max_gamma == 16
    assert list(info.jury_shards) == stack.jury_addresses
    assert info.draft_model == "draft (llama, 4 layers)"
    stack.generation().Generate(to_pb("hi", max_new_tokens=8, seed=2), timeout=30)
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in (
        "hydrajury_requests_total",
        "hydrajury_tokens_emitted_total",
        "hydrajury_draft_tokens_total",
        "hydrajury_accepted_tokens_total",
        "hydrajury_time_to_first_token_seconds_bucket",
        'hydrajury_round_phase_seconds_count{phase="score"}',
        "hydrajury_active_sessions",
        "hydrajury_draft_position_reached_total",
        'hydrajury_session_events_total{event="created"}',
        "hydrajury_reused_context_tokens_total",
    ):
        assert name in text, name


def samples(url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics as {(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_each_heads_drafts_and_votes_are_counted(stack):
    """The per-head metrics the chart's poisoned-head alerts read: a draft head's drafted
    and kept tokens, and each juror's votes on the emitted tokens and its dissents (its
    argmax another token), against the response's own records."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    before = samples(url)
    options = {"max_new_tokens": 12, "seed": 3, "gamma": 3, "temperature": 1.0, "ignore_eos": True}
    request = to_pb("the dog", rule="exact", drafter="head", draft_head="head1", **options)
    response = stack.generation().Generate(request, timeout=30)
    after = samples(url)

    def added(name: str, head: str) -> float:
        key = (name, (("head", head),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert added("hydrajury_head_draft_tokens_total", "head1") == response.stats.drafted > 0
    assert added("hydrajury_head_accepted_tokens_total", "head1") == response.stats.accepted
    assert added("hydrajury_head_draft_tokens_total", "head0") == 0
    assert "head1" not in response.jury  # the draft head is no juror of its own drafts
    for head in ALL_HEADS:
        voted = [token for token in response.tokens if head in token.votes]
        dissents = sum(token.votes[head] != token.token_id for token in voted)
        assert added("hydrajury_juror_votes_total", head) == len(voted), head
        assert added("hydrajury_juror_dissents_total", head) == dissents, head
        assert bool(voted) == (head in response.jury), head
    assert after[("hydrajury_session_store_up", ())] == 1
    ready = {k[1][0][1]: v for k, v in after.items() if k[0] == "hydrajury_ready_replicas"}
    assert ready == ({} if stack.embedded else dict.fromkeys(stack.holders, 1))


def test_close_session(stack):
    generation = stack.generation()
    with pytest.raises(grpc.RpcError) as raised:
        generation.CloseSession(generation_pb2.CloseSessionRequest(session_id="nope"), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    session_id = f"mine-{time.monotonic_ns()}"
    created = generation.CreateSession(
        generation_pb2.CreateSessionRequest(session_id=session_id), timeout=5
    )
    assert created.session_id == session_id
    request = to_pb("hi", max_new_tokens=100, gamma=1, seed=1, ignore_eos=True)
    request.session_id = session_id
    stream = generation.GenerateStream(request, timeout=30)
    next(stream)
    held = {n: stack.active_sessions(n) for n in stack.holders}
    closed = generation.CloseSession(
        generation_pb2.CloseSessionRequest(session_id=session_id), timeout=5
    )
    assert closed.closed
    with pytest.raises(grpc.RpcError) as raised:
        list(stream)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert "was closed" in raised.value.details()
    assert wait_for(lambda: all(stack.active_sessions(n) == held[n] - 1 for n in stack.holders))


def test_layouts_are_checked(jury_checkpoint):
    stack = Stack(str(jury_checkpoint), [["head0", "head1"], ["head1", "head2"], ["head3"]])
    stack.start_services()
    try:
        trunk, (a, b, c) = stack.addresses["trunk"], stack.jury_addresses
        with pytest.raises(LayoutError, match="'head1' is hosted by both"):
            GrpcBackend.static(trunk, [a, b, c])
        with pytest.raises(LayoutError, match=r"no jury shard hosts heads \['head2', 'head3'\]"):
            GrpcBackend.static(trunk, [a])
        with pytest.raises(LayoutError, match="shards must host disjoint heads"):
            GrpcBackend.static(trunk, [b, a])
    finally:
        stack.close()


def test_services_of_another_checkpoint_are_refused(jury_checkpoint, hydra_checkpoints):
    ours = Stack(str(jury_checkpoint), [ALL_HEADS]).start_services()
    other = Stack(str(hydra_checkpoints["llama"]), [["head0", "head1", "head2"]])
    other.start_services()
    try:
        with pytest.raises(LayoutError, match="all services must load the same checkpoint"):
            GrpcBackend.static(ours.addresses["trunk"], other.jury_addresses)
    finally:
        ours.close()
        other.close()


def test_a_shard_going_down_is_unavailable_and_names_it(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url)
    stack.start_services().start_orchestrator()
    try:
        generation = stack.generation()
        generation.Generate(to_pb("hi", max_new_tokens=4, seed=1), timeout=30)
        down = stack.addresses["jury1"]
        stack.stop_server("jury1")
        with pytest.raises(grpc.RpcError) as raised:
            generation.Generate(to_pb("hi", max_new_tokens=4, seed=1), timeout=30)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"jury shard 1 at {down}" in raised.value.details()
    finally:
        stack.close()


def test_deadline_propagates(stack):
    generation = stack.generation()
    session_id = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    request = to_pb("hi", max_new_tokens=100, gamma=1, seed=1, ignore_eos=True)
    request.session_id = session_id.session_id
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(request, timeout=0.05)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The lease was given back: the session takes the next request.
    request.options.max_new_tokens = 2
    assert len(retry_busy(lambda: generation.Generate(request, timeout=30)).token_ids) == 2
