"""Finished generations never make a service refuse a new one: their caches stay for a next
turn, but their slots go to newcomers at once; a newcomer is refused only when every slot
holds a running generation, and then no running one loses its caches."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.protos.hydrajury.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    internal_pb2,
    internal_pb2_grpc,
)
from hydra_jury.workers.errors import SESSIONS_RUNNING
from hydra_jury.workers.sessions import FINISHED, IDLE
from tests.grpc_stack import Stack
from tests.orchestrator.sessions.test_sessions_api import chat, user
from tests.orchestrator.test_grpc_stack import to_pb

THREADS = 8
# Per thread. The bug this guards against refused requests once the 16 default slots held
# finished sessions younger than the 1 s reclaim grace: "after a few dozen requests". 8 x 24
# requests fill the slots 12 times over, each refill within a fraction of a second (16
# requests take 0.8 s with the machine to themselves). 8 x 60 cost the suite about 40 s
# more of its 2 cores.
REQUESTS_PER_THREAD = 24
SLOTS = 16


def one_shot(index: int) -> generation_pb2.GenerateRequest:
    """A request with no session id: 2 seeded, sampled tokens."""
    return to_pb("the cat", max_new_tokens=2, seed=index, temperature=0.9, top_k=12)


@pytest.mark.slow
def test_one_shot_requests_from_eight_threads_are_never_refused(jury_checkpoint):
    """`hydra-jury up` with its default flags (16 slots, 1 s grace) and real processes."""
    stack = LocalStack(str(jury_checkpoint), shards=2, port=0)
    try:
        address = stack.start(timeout_s=120)
        generation = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
        failures = []

        def client(thread: int) -> None:
            for i in range(REQUESTS_PER_THREAD):
                try:
                    generation.Generate(one_shot(thread * REQUESTS_PER_THREAD + i), timeout=60)
                except grpc.RpcError as error:
                    failures.append(f"{error.code().name}: {error.details()}")

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(client, range(THREADS)))
        assert failures == [], f"{len(failures)} refused, the first: {failures[0]}"
        trunk = next(child.address for child in stack.children if child.name == "trunk")
        info = internal_pb2_grpc.TrunkStub(grpc.insecure_channel(trunk)).Info(
            internal_pb2.InfoRequest(), timeout=5
        )
        # Every slot holds a finished session, kept for a next turn that may come.
        assert info.limits.active_sessions == info.limits.max_sessions == SLOTS
    finally:
        stack.stop()


def sample(stack: Stack, service: str, name: str, **labels: str) -> float:
    registry = stack.servers[service].servicer.metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


def test_running_generations_keep_their_slots_and_newcomers_are_refused_quickly(
    jury_checkpoint, redis_url
):
    stack = Stack(
        str(jury_checkpoint),
        [["head0", "head1"], ["head2", "head3"]],
        redis_url,
        max_sessions=SLOTS,
        # Longer than the default 1 s: a running generation whose next call comes later
        # than the grace may lose its slot to a newcomer, and with four test processes on
        # two cores 16 streams' rounds were once more than 1 s apart (a newcomer then took
        # a slot, and its former holder failed rebuilding its caches).
        reclaim_after_s=10.0,
    ).start_services()
    try:
        stack.start_orchestrator()
        generation = stack.generation()
        long = {"max_new_tokens": 48, "ignore_eos": True, "gamma": 2, "temperature": 0.0}
        streams = [
            generation.GenerateStream(to_pb("the cat", **long), timeout=120) for _ in range(SLOTS)
        ]
        started = [next(stream) for stream in streams]  # all 16 are running now
        assert all(message.session_id for message in started)

        refused = []
        for _ in range(24 - SLOTS):
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                generation.Generate(to_pb("a dog", max_new_tokens=4), timeout=30)
            refused.append((error.value.code(), error.value.details(), time.monotonic() - began))
        for code, details, seconds in refused:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "in use by running generations" in details
            assert seconds < 2.0, "refused, but slowly"

        def drain(stream) -> int:
            return sum(len(message.tokens) for message in stream)

        with ThreadPoolExecutor(SLOTS) as pool:
            rest = list(pool.map(drain, streams))
        assert [len(m.tokens) + n for m, n in zip(started, rest, strict=True)] == [48] * SLOTS
        for service in stack.holders:
            # No running generation lost its caches; none were finished while refused.
            assert sample(stack, service, "hydrajury_reclaimed_sessions_total", reason=IDLE) == 0
            assert sample(stack, service, "hydrajury_service_running_sessions") == 0
        assert (
            sample(
                stack,
                "trunk",
                "hydrajury_refused_calls_total",
                rpc="Prefill",
                reason=SESSIONS_RUNNING,
            )
            == 24 - SLOTS
        )
        # Every slot is free for the next ones: 16 newcomers take the finished slots.
        with ThreadPoolExecutor(SLOTS) as pool:
            list(pool.map(lambda i: generation.Generate(one_shot(i), timeout=60), range(SLOTS)))
        reclaimed = sample(stack, "trunk", "hydrajury_reclaimed_sessions_total", reason=FINISHED)
        assert reclaimed >= SLOTS
    finally:
        stack.close()


@pytest.mark.parametrize("embedded", [False, True], ids=["two-shards", "single-process"])
def test_a_session_whose_caches_other_traffic_took_continues_with_the_same_tokens(
    jury_checkpoint, redis_url, embedded
):
    """Two slots and a grace of a minute: without the finished state, other traffic could
    not even start while the conversation waits between turns."""
    stack = Stack(str(jury_checkpoint), [], redis_url, max_sessions=2, reclaim_after_s=60)
    if embedded:
        stack.start_embedded()
    else:
        stack.shards = [["head0", "head1"], ["head2", "head3"]]
        stack.start_services().start_orchestrator()
    try:
        generation = stack.generation()
        sampled = {"temperature": 0.9, "gamma": 3, "top_k": 12, "seed": 5}
        first = generation.Generate(chat([user("remember")], **sampled), timeout=30)
        for i in range(2):  # other traffic takes both slots
            generation.Generate(one_shot(i), timeout=30)
        second = generation.Generate(
            chat([user("again")], session_id=first.session_id, **sampled), timeout=30
        )
        unbroken = generation.Generate(
            chat([user("remember"), ("assistant", first.text), user("again")], **sampled),
            timeout=30,
        )
        assert list(second.token_ids) == list(unbroken.token_ids)
        assert second.stats.reused_tokens == 0  # rebuilt from the session's record
    finally:
        stack.close()


def test_a_finished_session_s_slot_is_reported_reclaimed(jury_checkpoint, redis_url):
    """The single-process server's metrics count reclaimed slots by reason too."""
    stack = Stack(str(jury_checkpoint), [], redis_url, max_sessions=1, reclaim_after_s=60)
    stack.start_embedded(metrics_port=0)
    try:
        generation = stack.generation()
        for i in range(3):
            generation.Generate(one_shot(i), timeout=30)
        registry = stack.servicer.metrics.registry
        reclaimed = registry.get_sample_value(
            "hydrajury_reclaimed_sessions_total", {"reason": FINISHED}
        )
        assert reclaimed == 2
        assert registry.get_sample_value("hydrajury_service_running_sessions") == 0
    finally:
        stack.close()
