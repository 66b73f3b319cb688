"""Failover with real processes: an orchestrator killed (SIGKILL) or frozen past its
lease (SIGSTOP) mid-generation, and Redis killed mid-generation. The request, sent again
with the same session and request ids, ends with the tokens of an uninterrupted run; a
frozen owner that wakes up is fenced off; a record is never between two rounds."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

import grpc
import pytest

from hydra_jury.orchestrator.launcher import start_child
from hydra_jury.orchestrator.sessions.redis_server import LocalRedis
from hydra_jury.orchestrator.sessions.store import StoreSettings
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from tests.grpc_stack import Stack
from tests.orchestrator.sessions.test_sessions_api import GREEDY, SAMPLED, chat, user

LEASE_S = 1.0
LONG = {"max_new_tokens": 150, "ignore_eos": True}


def start_stack(checkpoint, redis_url: str) -> Stack:
    stack = Stack(str(checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url)
    stack.max_session_tokens = 256
    stack.sessions = StoreSettings(ttl_s=60, lease_s=LEASE_S)
    return stack.start_services().start_orchestrator()


@contextmanager
def orchestrator_process(stack: Stack, *flags: str):
    """A second orchestrator, in a process of its own, on the same services and sessions
    (with `flags` besides): the started child, killed (if still alive) on leaving."""
    command = [sys.executable, "-m", "hydra_jury.orchestrator", *stack.orchestrator_argv()]
    child = start_child(
        "orchestrator-a", [*command, "--session-lease-s", str(LEASE_S), *flags], timeout_s=120
    )
    assert child.address, child.failure
    try:
        yield child
    finally:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait()


@contextmanager
def second_orchestrator(stack: Stack, *flags: str):
    """`orchestrator_process`: its process and a client of it."""
    with orchestrator_process(stack, *flags) as child, grpc.insecure_channel(child.address) as c:
        yield child.process, generation_pb2_grpc.GenerationStub(c)


def reference_and_resumable(generation, text: str, request_id: str, options: dict):
    """The response to `text` generated uninterrupted, and the same request in a new session
    under `request_id`: the one to interrupt and then send again."""
    reference = generation.Generate(chat([user(text)], **options), timeout=60)
    session = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    request = chat([user(text)], session_id=session.session_id, request_id=request_id, **options)
    return reference, request


def assert_between_rounds(record) -> None:
    """The record is as of a round's end: its tokens are context plus what was generated."""
    generation = record.generation
    assert (
        record.tokens == record.tokens[: generation.context_length] + generation.progress.generated
    )
    assert len(record.tokens) == generation.context_length + len(generation.progress.generated)
    assert sum(generation.progress.round_sizes) == len(generation.progress.generated)


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = start_stack(jury_checkpoint, redis_url)
    yield stack
    stack.close()


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_killed_orchestrator_s_request_resumes_on_another(stack, options):
    options = {**options, **LONG}
    survivor = stack.generation()
    reference, request = reference_and_resumable(survivor, "tell me", "r-kill", options)
    with second_orchestrator(stack) as (process, doomed):
        stream = doomed.GenerateStream(request, timeout=60)
        for _ in range(3):
            next(stream)
        process.send_signal(signal.SIGKILL)
        process.wait()
        interrupted = stack.load_record(request.session_id)
        assert_between_rounds(interrupted)
        assert not interrupted.generation.finished  # it really was cut mid-generation
        # The survivor waits out the dead owner's lease, then goes on from its last round.
        resumed = survivor.Generate(request, timeout=60)
    assert list(resumed.token_ids) == list(reference.token_ids)
    assert resumed.stats.resumed_rounds == len(interrupted.generation.progress.round_sizes) > 0


def test_a_frozen_owner_is_fenced_off_when_it_wakes(stack):
    options = {**SAMPLED, **LONG}
    survivor = stack.generation()
    reference, request = reference_and_resumable(survivor, "freeze", "r-stop", options)
    with second_orchestrator(stack) as (process, frozen):
        stream = frozen.GenerateStream(request, timeout=60)
        next(stream)
        os.kill(process.pid, signal.SIGSTOP)
        stale_cache = stack.load_record(request.session_id).cache_id
        resumed = survivor.Generate(request, timeout=60)  # takes over once the lease ran out
        os.kill(process.pid, signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as raised:
            list(stream)
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert "taken over" in raised.value.details()
    assert list(resumed.token_ids) == list(reference.token_ids)
    record = stack.load_record(request.session_id)
    assert record.cache_id != stale_cache  # the new owner never read the stale caches
    assert record.result["output"]["token_ids"] == list(reference.token_ids)
    assert record.owner == "" and record.generation.finished


@pytest.mark.parametrize("persistent", [True, False], ids=["redis-keeps-data", "redis-loses-data"])
def test_redis_killed_mid_generation(jury_checkpoint, tmp_path, persistent):
    redis = LocalRedis(data_dir=tmp_path if persistent else None).start()
    stack = start_stack(jury_checkpoint, redis.url)
    try:
        generation = stack.generation()
        options = {**SAMPLED, **LONG}
        reference, request = reference_and_resumable(generation, "redis", "r-redis", options)
        stream = generation.GenerateStream(request, timeout=60)
        next(stream)
        redis.kill()
        with pytest.raises(grpc.RpcError) as raised:
            list(stream)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis at" in raised.value.details()
        redis = LocalRedis(port=redis.port, data_dir=redis.data_dir).start()
        if persistent:
            assert_between_rounds(stack.load_record(request.session_id))
            resumed = generation.Generate(request, timeout=60)
            assert list(resumed.token_ids) == list(reference.token_ids)
        else:
            with pytest.raises(grpc.RpcError) as raised:
                generation.Generate(request, timeout=60)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stack.close()
        redis.stop()


def test_two_orchestrators_racing_on_one_session(stack):
    """The same session sent to two orchestrators at once: exactly one advances it, the
    other is ABORTED, and the record is the winner's, field by field."""
    from concurrent.futures import ThreadPoolExecutor

    if "orchestrator2" not in stack.servers:
        stack.start_orchestrator("orchestrator2")
    first, second = stack.generation(), stack.generation("orchestrator2")
    session = first.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    options = {**SAMPLED, **LONG}

    def send(stub, text):
        try:
            return stub.Generate(chat([user(text)], session_id=session.session_id, **options), 60)
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(send, [first, second], ["one", "two"]))
    winners = [r for r in results if isinstance(r, generation_pb2.GenerateResponse)]
    losers = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(winners) == len(losers) == 1
    assert losers[0].code() == grpc.StatusCode.ABORTED and "busy" in losers[0].details()
    record = stack.load_record(session.session_id)
    winner = winners[0]
    assert record.generation.progress.generated == list(winner.token_ids)
    assert record.tokens == record.tokens[: winner.prompt_tokens] + list(winner.token_ids)
    assert record.result["output"]["token_ids"] == list(winner.token_ids)
    assert record.messages[-1] == {"role": "assistant", "content": winner.text}
    assert record.owner == "" and record.processed == len(record.tokens) - 1
    assert_between_rounds(record)
