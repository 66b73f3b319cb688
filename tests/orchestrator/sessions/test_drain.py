"""Graceful drain: a Generation server told to stop (SIGTERM) reports NOT_SERVING, refuses
new generations with UNAVAILABLE, lets the running ones finish within its grace and
exits 0. Past the grace, a running generation stops after its last committed round with
UNAVAILABLE naming its ids, and the same request on another server completes it with
the tokens of an uninterrupted run. With real orchestrator processes and in-process."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydra_jury.orchestrator.server import SERVICE_NAME
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc
from tests.grpc_stack import Stack, wait_for
from tests.orchestrator.sessions.test_failover import (
    assert_between_rounds,
    reference_and_resumable,
    second_orchestrator,
    start_stack,
)
from tests.orchestrator.sessions.test_sessions_api import SAMPLED, chat, user

Code = grpc.StatusCode
# Long enough that the generation is still running when the signal arrives: one token a
# round, up to the services' 256 positions per session.
LONG = {**SAMPLED, "gamma": 1, "max_new_tokens": 200, "ignore_eos": True}
DRAINING = "this server is draining (shutting down) and takes no new generations"


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = start_stack(jury_checkpoint, redis_url)
    yield stack
    stack.close()


def tokens_of(messages) -> list[int]:
    return [token.token_id for message in messages for token in message.tokens]


def assert_refuses_new_generations(generation: generation_pb2_grpc.GenerationStub) -> None:
    """A new generation sent to a draining server is UNAVAILABLE, saying why (the signal
    may take a moment to arrive: until then one is still taken, and runs)."""

    def refused() -> bool:
        try:
            generation.Generate(chat([user("new")], max_new_tokens=1), timeout=30)
        except grpc.RpcError as error:
            assert error.code() == Code.UNAVAILABLE and DRAINING in error.details(), error
            return True
        return False

    assert wait_for(refused)


def test_sigterm_lets_a_running_generation_finish(stack):
    survivor = stack.generation()
    reference, request = reference_and_resumable(survivor, "drain", "r-drain", LONG)
    with second_orchestrator(stack, "--grace-s", "60") as (process, draining):
        stream = draining.GenerateStream(request, timeout=60)
        first = next(stream)
        process.send_signal(signal.SIGTERM)
        assert_refuses_new_generations(draining)
        rest = list(stream)  # no error: it ran to its end
        assert process.wait(timeout=60) == 0
    assert rest[-1].finish_reason == "length"
    assert tokens_of([first, *rest]) == list(reference.token_ids)
    record = stack.load_record(request.session_id)
    assert record.generation.finished and record.owner == ""


def test_past_the_grace_a_generation_stops_resumably_and_resumes_elsewhere(stack):
    survivor = stack.generation()
    reference, request = reference_and_resumable(survivor, "cut short", "r-grace", LONG)
    with second_orchestrator(stack, "--grace-s", "0") as (process, draining):
        stream = draining.GenerateStream(request, timeout=60)
        next(stream)
        process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as raised:
            list(stream)
        assert process.wait(timeout=60) == 0
    assert raised.value.code() == Code.UNAVAILABLE
    assert raised.value.details() == (
        "this server is shutting down: the generation stopped after its last committed "
        f"round; send the request again with session_id {request.session_id!r} and "
        "request_id 'r-grace' to continue it"
    )
    interrupted = stack.load_record(request.session_id)
    assert_between_rounds(interrupted)
    assert not interrupted.generation.finished
    assert interrupted.owner == ""  # the lease was given back: no wait to resume
    resumed = survivor.Generate(request, timeout=60)
    assert list(resumed.token_ids) == list(reference.token_ids)
    assert resumed.stats.resumed_rounds == len(interrupted.generation.progress.round_sizes) > 0


def test_a_draining_server_reports_not_serving_until_its_generations_end(
    jury_checkpoint, redis_url
):
    stack = Stack(str(jury_checkpoint), [], redis_url, max_session_tokens=256).start_embedded()
    try:
        generation = stack.generation()
        health = health_pb2_grpc.HealthStub(stack.channel("orchestrator"))
        stream = generation.GenerateStream(chat([user("hold on")], **LONG), timeout=60)
        first = next(stream)
        running = stack.servers.pop("orchestrator")
        stopping = threading.Thread(target=stack.loop.run, args=(running.stop(60.0), 90))
        stopping.start()

        def not_serving() -> bool:
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            status = health.Check(request, timeout=5).status
            return status == health_pb2.HealthCheckResponse.NOT_SERVING

        assert wait_for(not_serving)
        assert_refuses_new_generations(generation)
        rest = list(stream)
        stopping.join()
        assert len(tokens_of([first, *rest])) == LONG["max_new_tokens"]
    finally:
        stack.close()
