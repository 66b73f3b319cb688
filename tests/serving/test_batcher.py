"""Continuous batching in the services: concurrent calls of different sessions run as one
forward with the results of running each alone; a bad call fails alone; a full queue
and a long wait are RESOURCE_EXHAUSTED with a retry hint, and nothing hangs."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
import torch

from hydra_jury.protos.hydrajury.v1 import internal_pb2
from hydra_jury.serving.batcher import BatchLimits, CallBatcher, run_isolated
from hydra_jury.serving.model_thread import ModelThread
from tests.worker_services import (
    HIDDEN_SIZE,
    TurnPeer,
    assert_error,
    decoded,
    draft_request,
    jury_prefill_request,
    prefill_request,
    score_request,
)


def test_run_isolated_keeps_a_failure_to_its_call():
    def run_batch(calls):
        if any(call < 0 for call in calls):
            raise ValueError("a negative call spoils the batch")
        return [call * 2 for call in calls]

    def run_one(call):
        if call < 0:
            raise ValueError(f"{call} is negative")
        return call * 2

    assert run_isolated([1, 2], run_batch, run_one) == [2, 4]
    results = run_isolated([1, -1, 3], run_batch, run_one)
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError) and "-1 is negative" in str(results[1])
    with pytest.raises(ValueError, match="spoils"):
        run_isolated([-1], run_batch, run_one)  # alone: its own error, raised


class Blocked:
    """Holds a service's model thread until released, so that calls pile up."""

    def __init__(self, servicer) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

        def hold() -> None:
            self.started.set()
            self.release.wait(10)

        threading.Thread(target=servicer.thread.call, args=(hold,), daemon=True).start()
        assert self.started.wait(5)


def batched(service, rpc: str, sentinel, requests, extra=(), hold_s: float = 0.0) -> list:
    """Sends `requests` while the model thread is held and a `sentinel` call is already
    taken, so that they all wait and run as one batch; then `extra` calls, once those
    wait; holds the thread `hold_s` longer. The results or errors of both, in order."""
    batcher = service.servicer.batchers[rpc]
    method = getattr(service.stub, rpc)
    blocked = Blocked(service.servicer)
    first = method.future(sentinel, timeout=10)
    wait_until(lambda: batcher.running == 1)
    futures = [method.future(request, timeout=10) for request in requests]
    wait_until(lambda: batcher.queued == len(requests))
    futures += [method.future(request, timeout=10) for request in extra]
    wait_until(lambda: all(future.done() for future in futures[len(requests) :]))
    time.sleep(hold_s)
    blocked.release.set()
    first.result()
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result())
        except grpc.RpcError as error:
            outcomes.append(error)
    return outcomes


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def hidden_states(rows: int, seed: int):
    from hydra_jury.protos.codec import tensor_to_pb

    return tensor_to_pb(
        torch.randn(rows, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed))
    )


def test_concurrent_scores_run_as_one_batch_with_the_results_of_each_alone(start_jury):
    jury = start_jury(max_sessions=8)
    sessions = [f"s{i}" for i in range(5)]
    for index, session in enumerate(sessions):
        prefill = jury_prefill_request(session, 0, positions=3 + index)
        prefill.hidden.CopyFrom(hidden_states(3 + index, index))
        jury.stub.Prefill(prefill, timeout=10)
    requests = [
        score_request(session, 3 + i, hidden=hidden_states(2, 100 + i))
        for i, session in enumerate(sessions)
    ]
    alone = [jury.stub.Score(request, timeout=10) for request in requests]
    together = batched(jury, "Score", requests[0], requests)
    assert jury.servicer.batchers["Score"].largest == len(requests)  # one forward
    for one, joined in zip(alone, together, strict=True):
        torch.testing.assert_close(
            decoded(joined.log_product), decoded(one.log_product), atol=1e-5, rtol=1e-5
        )
        assert decoded(joined.votes).tolist() == decoded(one.votes).tolist()


def test_a_bad_call_fails_alone(start_jury):
    jury = start_jury()
    jury.stub.Prefill(jury_prefill_request("known", 0, positions=3), timeout=10)
    good = score_request("known", 3)
    unknown = score_request("never-prefilled", 3)
    ok, refused = batched(jury, "Score", good, [good, unknown])
    assert jury.servicer.batchers["Score"].largest == 2
    assert ok.log_product.shape == [2, 32]
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "never-prefilled" in refused.details()


def test_concurrent_trunk_prefills_and_plain_steps_are_batched(start_trunk):
    trunk = start_trunk(max_sessions=8)
    for session in ("a", "b", "c"):
        trunk.stub.Prefill(prefill_request(session), timeout=10)
    steps = [draft_request(session, draft_head="", gamma=1) for session in ("a", "b", "c")]
    alone = [trunk.stub.Draft(step, timeout=10) for step in steps]
    for one, together in zip(alone, batched(trunk, "Draft", steps[0], steps), strict=True):
        torch.testing.assert_close(
            decoded(together.hidden), decoded(one.hidden), atol=1e-5, rtol=1e-5
        )
    assert trunk.servicer.batchers["Draft"].largest == 3
    # Prefills of new sessions join one forward too, whatever their lengths.
    requests = [prefill_request(f"n{i}", tokens=list(range(3, 5 + i))) for i in range(3)]
    results = batched(trunk, "Prefill", prefill_request("a"), requests)
    assert [len(decoded(result.hidden)) for result in results] == [2, 3, 4]
    assert trunk.servicer.batchers["Prefill"].largest == 3


def test_a_full_queue_is_resource_exhausted_with_a_retry_hint(start_jury):
    jury = start_jury(batch_limits=BatchLimits(max_queue=2))
    jury.stub.Prefill(jury_prefill_request("s", 0, positions=3), timeout=10)
    request = score_request("s", 3)
    outcomes = batched(jury, "Score", request, [request] * 2, extra=[request] * 2)
    assert all(outcome.log_product.shape == [2, 32] for outcome in outcomes[:2])
    for refused in outcomes[2:]:
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 calls are queued (the most is 2); retry in about" in refused.details()
    assert jury.servicer.batchers["Score"].queued == 0  # nothing left behind
    assert jury.stub.Release(internal_pb2.ReleaseRequest(session="s"), timeout=10).released
    pool = jury.servicer.worker.pool
    assert pool.free_slots == pool.num_slots  # every cache slot is free again


def test_a_call_that_waits_too_long_is_refused(start_jury):
    jury = start_jury(batch_limits=BatchLimits(max_wait_s=0.05))
    jury.stub.Prefill(jury_prefill_request("s", 0, positions=3), timeout=10)
    request = score_request("s", 3)
    (refused,) = batched(jury, "Score", request, [request], hold_s=0.2)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited" in refused.details() and "retry in about" in refused.details()


def test_draft_calls_join_and_leave_between_steps(start_trunk):
    """Different draft heads, different γ, a plain step among them: each batch is one
    step — one trunk forward over every session still drafting — calls join at the step
    after they arrive, and each session gets its tokens, draft distributions and hidden
    states alone."""
    trunk = start_trunk(max_sessions=8)
    for session in ("a", "b", "c", "d", "running"):
        trunk.stub.Prefill(prefill_request(session), timeout=10)
    calls = [
        draft_request("a", draft_head="head0", gamma=4),
        draft_request("b", draft_head="head2", gamma=2),
        draft_request("c", draft_head="head0", gamma=3, pending=7),
        draft_request("d", draft_head="", gamma=1),
    ]
    alone = [trunk.stub.Draft(call, timeout=10) for call in calls]
    steps = trunk.servicer.worker.counters.trunk_calls
    running = draft_request("running", draft_head="head1", gamma=4)
    together = batched(trunk, "Draft", running, calls)
    # The running call's first step alone; the four join its second: 1 + 4 steps in
    # all (the calls alone took 4 + 2 + 3 + 1).
    assert trunk.servicer.worker.counters.trunk_calls - steps == 5
    assert trunk.servicer.batchers["Draft"].largest == 5
    for one, joined in zip(alone, together, strict=True):
        assert list(joined.tokens) == list(one.tokens)
        torch.testing.assert_close(
            decoded(joined.hidden), decoded(one.hidden), atol=1e-5, rtol=1e-5
        )
        if one.tokens:
            torch.testing.assert_close(
                decoded(joined.logprobs), decoded(one.logprobs), atol=1e-5, rtol=1e-5
            )
    assert len(trunk.servicer.draft_scheduler) == 0  # nothing left behind


def test_a_session_drafting_is_held_and_its_release_fails_only_its_call(start_trunk):
    """A draft call spans several batches: its session is never reclaimed as idle in
    between, a second draft call of it is refused, and releasing it fails that call
    alone (its slot is never written after the release)."""
    trunk = start_trunk(max_sessions=2, reclaim_after_s=0.0)
    for session in ("a", "b"):
        trunk.stub.Prefill(prefill_request(session), timeout=10)
    blocked = Blocked(trunk.servicer)
    long = trunk.stub.Draft.future(draft_request("a", gamma=6), timeout=10)
    wait_until(lambda: trunk.servicer.batchers["Draft"].running == 1)
    other = trunk.stub.Draft.future(draft_request("b", gamma=2), timeout=10)
    again = trunk.stub.Draft.future(draft_request("a", gamma=2), timeout=10)
    # A new session needs a slot: "b" (idle) is reclaimed, never "a" (drafting).
    newcomer = trunk.stub.Prefill.future(prefill_request("c"), timeout=10)
    wait_until(lambda: trunk.servicer.batchers["Draft"].queued == 2)
    # The newcomer waits for the model thread's turn ahead of the drafts' next step, in
    # which "b" would be drafting (held, so not reclaimable).
    wait_until(lambda: trunk.servicer.batchers["Prefill"].queued == 1)
    time.sleep(0.05)  # its batcher in line for the turn
    blocked.release.set()
    newcomer.result()
    assert len(long.result().tokens) == 6
    with pytest.raises(grpc.RpcError) as refused:
        again.result()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another draft call of it is still running" in refused.value.details()
    with pytest.raises(grpc.RpcError) as lost:
        other.result()
    assert lost.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # "b" was reclaimed

    # Released while drafting: that call fails, the caches are not touched after.
    trunk.stub.Prefill(prefill_request("a"), timeout=10)
    blocked = Blocked(trunk.servicer)
    drafting = trunk.stub.Draft.future(draft_request("a", gamma=6), timeout=10)
    wait_until(lambda: trunk.servicer.batchers["Draft"].running == 1)
    release = trunk.stub.Release.future(internal_pb2.ReleaseRequest(session="a"), timeout=10)
    time.sleep(0.05)
    blocked.release.set()
    assert release.result().released
    with pytest.raises(grpc.RpcError) as gone:
        drafting.result()
    assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "released while drafting" in gone.value.details()
    assert len(trunk.servicer.draft_scheduler) == 0


def scrape(service) -> dict[tuple[str, tuple], float]:
    """The service's /metrics, as {(sample name, sorted labels): value}."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{service.running.metrics_port}/metrics"
    with urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_batches_queue_and_refusals_are_exported_as_metrics(start_jury):
    jury = start_jury(batch_limits=BatchLimits(max_queue=2), metrics_port=0)
    jury.stub.Prefill(jury_prefill_request("s", 0, positions=3), timeout=10)
    request = score_request("s", 3)
    outcomes = batched(jury, "Score", request, [request] * 2, extra=[request])
    assert outcomes[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    metrics = scrape(jury)
    score = (("rpc", "Score"),)
    rows = len(decoded(request.hidden))
    # The sentinel's batch of one, then the two queued calls as one batch.
    assert metrics[("hydrajury_batch_calls_count", score)] == 2
    assert metrics[("hydrajury_batch_calls_sum", score)] == 3
    assert metrics[("hydrajury_batch_tokens_sum", score)] == 3 * rows
    assert metrics[("hydrajury_queue_wait_seconds_count", score)] == 3
    assert metrics[("hydrajury_batch_seconds_count", score)] == 2
    assert metrics[("hydrajury_queue_length", score)] == 0
    assert metrics[("hydrajury_refused_calls_total", (("reason", "queue_full"), *score))] == 1
    assert metrics[("hydrajury_batch_calls_count", (("rpc", "Prefill"),))] == 1
    assert metrics[("hydrajury_service_sessions", ())] == 1


def test_split_and_concat_rows_keep_the_bytes():
    from hydra_jury.protos.codec import concat_rows, split_rows, tensor_from_pb, tensor_to_pb

    tensor = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    pieces = split_rows(tensor_to_pb(tensor), 4)
    assert [list(piece.shape) for piece in pieces] == [[4, 3], [4, 3], [2, 3]]
    joined = tensor_from_pb(concat_rows(pieces), name="t", dtypes=["float32"], shape=[10, 3])
    assert torch.equal(joined, tensor)
    assert split_rows(tensor_to_pb(tensor), 10) == [tensor_to_pb(tensor)]
    malformed = tensor_to_pb(tensor)
    malformed.data = malformed.data[:-4]  # left whole, for the receiver to refuse
    assert split_rows(malformed, 4) == [malformed]


LONG_PROMPT = [3, 8, 5, 6, 7, 9, 10, 12, 4, 11]


def test_a_long_trunk_prefill_runs_in_chunks_with_other_sessions_between(start_trunk):
    from hydra_jury.workers.calls import PrefillCall

    trunk = start_trunk(max_sessions=8, batch_limits=BatchLimits(prefill_chunk=4))
    worker = trunk.servicer.worker
    expected = trunk.servicer.thread.call(
        worker.prefill, PrefillCall("reference", 0, torch.tensor(LONG_PROMPT))
    )
    trunk.stub.Prefill(prefill_request("other"), timeout=10)
    blocked = Blocked(trunk.servicer)
    finished: list[str] = []
    prefill = trunk.stub.Prefill.future(prefill_request("long", tokens=LONG_PROMPT), timeout=10)
    prefill.add_done_callback(lambda _: finished.append("prefill"))
    wait_until(lambda: trunk.servicer.batchers["Prefill"].running == 1)
    step = trunk.stub.Draft.future(draft_request("other", draft_head="", gamma=1), timeout=10)
    step.add_done_callback(lambda _: finished.append("step"))
    wait_until(lambda: trunk.servicer.batchers["Draft"].queued == 1)
    time.sleep(0.05)  # its batcher in line for the model thread's turn
    blocked.release.set()
    hidden = decoded(prefill.result().hidden)
    step.result()
    assert finished == ["step", "prefill"]  # the step ran between the chunks
    torch.testing.assert_close(hidden, expected.tensor(), atol=1e-5, rtol=1e-5)
    assert worker.sessions.get("long", start=len(LONG_PROMPT)).trunk.length == len(LONG_PROMPT)


def test_a_chunked_prefill_is_checked_whole_before_its_first_chunk(start_trunk, start_jury):
    trunk = start_trunk(batch_limits=BatchLimits(prefill_chunk=4))
    sessions = len(trunk.servicer.worker.sessions)
    bad_last_token = [*LONG_PROMPT[:-1], 10**6]
    assert_error(
        trunk.stub.Prefill,
        prefill_request("long", tokens=bad_last_token),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokens",
    )
    assert len(trunk.servicer.worker.sessions) == sessions  # no session opened
    jury = start_jury(max_session_tokens=8, batch_limits=BatchLimits(prefill_chunk=4))
    refused = jury_prefill_request("long", 0, positions=10)
    with pytest.raises(grpc.RpcError) as error:
        jury.stub.Prefill(refused, timeout=10)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(jury.servicer.worker.sessions) == 0


def test_scores_after_a_chunked_jury_prefill_equal_those_after_a_whole_one(start_jury):
    from hydra_jury.workers.calls import HiddenStates, JuryPrefillCall

    jury = start_jury(max_sessions=8, batch_limits=BatchLimits(prefill_chunk=3))
    prompt = hidden_states(10, 7)
    reference = JuryPrefillCall("whole", 0, HiddenStates(10, decoded(prompt)))
    jury.servicer.thread.call(jury.servicer.worker.prefill, reference)
    chunked = internal_pb2.JuryPrefillRequest(session="chunked", start=0, hidden=prompt)
    jury.stub.Prefill(chunked, timeout=10)
    batches = jury.servicer.metrics.registry.get_sample_value(
        "hydrajury_batch_calls_count", {"rpc": "Prefill"}
    )
    assert batches == 4  # rows 3 + 3 + 3 + 1, one batch each
    after = hidden_states(2, 8)
    whole, parts = (
        jury.stub.Score(score_request(s, 10, hidden=after)) for s in ("whole", "chunked")
    )
    torch.testing.assert_close(
        decoded(parts.log_product), decoded(whole.log_product), atol=1e-5, rtol=1e-5
    )


def test_a_batch_smaller_than_the_recent_ones_waits_for_more_calls(start_jury):
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b", "c"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    scores = jury.servicer.batchers["Score"]
    batched(jury, "Score", score_request("a", 3), [score_request("b", 3), score_request("c", 3)])
    assert scores.largest == 2
    batches = jury.servicer.metrics.registry.get_sample_value
    before = batches("hydrajury_batch_calls_count", {"rpc": "Score"})
    first = jury.stub.Score.future(score_request("a", 3), timeout=10)
    time.sleep(0.1)  # the second call arrives inside the first one's window
    second = jury.stub.Score(score_request("b", 3), timeout=10)
    assert first.result().log_product.shape == second.log_product.shape
    assert batches("hydrajury_batch_calls_count", {"rpc": "Score"}) == before + 1


def test_calls_arriving_while_another_kind_runs_join_one_batch(start_trunk):
    """A batcher chooses its batch when the model thread is its: the draft calls that
    arrive while a prefill batch runs go into one batch, not one chosen early and the
    rest after it."""
    trunk = start_trunk(max_sessions=4)
    for session in ("a", "b"):
        trunk.stub.Prefill(prefill_request(session), timeout=10)
    drafts = trunk.servicer.batchers["Draft"]
    blocked = Blocked(trunk.servicer)
    prefill = trunk.stub.Prefill.future(prefill_request("c"), timeout=10)
    wait_until(lambda: trunk.servicer.batchers["Prefill"].running == 1)
    steps = [
        trunk.stub.Draft.future(draft_request(session, draft_head="", gamma=1), timeout=10)
        for session in ("a", "b")
    ]
    wait_until(lambda: drafts.queued == 2)
    time.sleep(0.05)  # their batcher in line for the model thread's turn
    blocked.release.set()
    prefill.result()
    for step in steps:
        assert step.result().trunk_steps == 1
    assert drafts.largest == 2 and drafts.running == 0


def test_a_window_that_ends_short_forgets_the_recent_batch_sizes(start_jury):
    """After a session has gone, the next batches do not wait for it: one window is
    spent, then a lone call runs at once."""
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=0.3))
    for session in ("a", "b", "c"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("a", 3), [score_request("b", 3), score_request("c", 3)])
    began = time.monotonic()
    jury.stub.Score(score_request("a", 3), timeout=10)
    waited = time.monotonic() - began
    began = time.monotonic()
    jury.stub.Score(score_request("b", 3), timeout=10)
    assert waited >= 0.3 and time.monotonic() - began < 0.2


def test_a_call_tells_its_share_of_the_batches_and_the_grpc_backend_counts_it(
    start_trunk, start_jury
):
    """A batched call's response carries its share of the batches it ran in (at most
    what it waited there); an unbatched one its time on the model thread. The gRPC
    backend hands them to the round that made the calls (the automatic drafter's cost)."""
    from hydra_jury.orchestrator.grpc_backend import GrpcBackend
    from hydra_jury.workers.calls import PrefillCall

    trunk, jury = start_trunk(max_sessions=4), start_jury()
    prefilled = trunk.stub.Prefill(prefill_request("a"), timeout=10).timings
    assert 0 < prefilled.share_ns <= prefilled.total_ns
    batch = internal_pb2.TrunkPrefillBatchRequest(calls=[prefill_request("b")])
    unbatched = trunk.stub.PrefillBatch(batch, timeout=10).timings
    assert 0 < unbatched.share_ns <= unbatched.total_ns
    backend = GrpcBackend.static(f"127.0.0.1:{trunk.port}", [f"127.0.0.1:{jury.port}"])
    try:
        with backend.sharing() as share:
            backend.prefill(PrefillCall("c", 0, torch.tensor(LONG_PROMPT), ("head0",)))
        assert 0 < share.share <= share.waited
    finally:
        backend.close()


def test_sessions_split_over_two_batches_meet_again_in_the_next(start_jury):
    """The window waits for the sessions that keep coming back, not only for as many
    calls as the largest of the last batches: two sessions that ran apart, each in a
    batch of its own, are waited for together."""
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    for _ in range(2):  # {a}, {b}, {a}, {b}
        batched(jury, "Score", score_request("a", 3), [score_request("b", 3)])
    batches = jury.servicer.metrics.registry.get_sample_value
    before = batches("hydrajury_batch_calls_count", {"rpc": "Score"})
    first = jury.stub.Score.future(score_request("a", 3), timeout=10)
    time.sleep(0.1)  # "b" arrives inside the window "a" waits in
    jury.stub.Score(score_request("b", 3), timeout=10)
    first.result()
    assert batches("hydrajury_batch_calls_count", {"rpc": "Score"}) == before + 1


def test_a_released_session_is_not_waited_for(start_jury):
    """A service's Release ends the session's part in its batches: the next Score call of
    the session left runs at once, not after a window spent waiting for the other."""
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("a", 3), [score_request("b", 3)])  # {a}, then {b}
    jury.stub.Release(internal_pb2.ReleaseRequest(session="b"), timeout=10)
    began = time.monotonic()
    jury.stub.Score(score_request("a", 3), timeout=10)
    assert time.monotonic() - began < 0.5


def test_a_round_s_calls_wait_for_every_session_seen_in_the_last_batches(start_jury):
    """Score calls come every round: a session seen once in the last batches is waited
    for, so that shards that each ran a different part of the sessions wait for all of
    them again (prefills, which come once a request, are not: the test below)."""
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("a", 3), [score_request("b", 3)])  # {a}, then {b}
    before = score_batches(jury)
    first = jury.stub.Score.future(score_request("a", 3), timeout=10)
    time.sleep(0.1)  # "b" arrives inside the window "a" waits in
    jury.stub.Score(score_request("b", 3), timeout=10)
    first.result()
    assert score_batches(jury) == before + 1


def test_sessions_that_come_once_are_not_waited_for(start_jury):
    """Prefills of sessions that each come once (one-off requests) do not make the next
    prefill wait for more: the window waits for sessions that came back."""
    jury = start_jury(max_sessions=8, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b", "c"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    began = time.monotonic()
    jury.stub.Prefill(jury_prefill_request("d", 0, positions=3), timeout=10)
    assert time.monotonic() - began < 0.5


@dataclass(frozen=True)
class Step:
    session: str


def two_phases(scenario) -> list[tuple[str, list[str]]]:
    """Runs `scenario(draft, score, thread)` over a Draft and a Score batcher sharing a
    model thread (a round's two calls in `serve`), with a window of 0.5 s, after
    sessions "a" and "b" ran a Draft and then a Score batch together; the batches run
    since, as (batcher, sessions)."""
    ran: list[tuple[str, list[str]]] = []

    def handler(name: str):
        def run(steps: list[Step]) -> list[None]:
            ran.append((name, sorted(step.session for step in steps)))
            return [None] * len(steps)

        return run

    async def main() -> None:
        thread = ModelThread("test-phases")
        try:
            limits = BatchLimits(window_s=0.5)
            draft = CallBatcher("Draft", thread, handler("Draft"), lambda step: 1, limits)
            score = CallBatcher("Score", thread, handler("Score"), lambda step: 1, limits)
            for batcher in (draft, score):
                await asyncio.gather(batcher.submit(Step("a")), batcher.submit(Step("b")))
            ran.clear()
            await scenario(draft, score, thread)
        finally:
            await asyncio.to_thread(thread.shutdown)

    asyncio.run(main())
    return ran


def test_sessions_on_their_way_are_waited_for_while_another_batcher_has_calls():
    """The last batch (Score) completed "a" and "b": their Draft calls are on the way.
    "a" is queued, "b" a little behind, and "c" waits for a Score batch: the Draft batch
    waits for "b" all the same. Run at once, "b" would stay a phase behind "a"."""

    async def scenario(draft, score, thread) -> None:
        first = asyncio.ensure_future(draft.submit(Step("a")))
        other = asyncio.ensure_future(score.submit(Step("c")))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, other, draft.submit(Step("b")))

    assert two_phases(scenario) == [("Draft", ["a", "b"]), ("Score", ["c"])]


def test_a_session_that_left_is_not_waited_for():
    """The generation of "b" ends (`ModelThread.session_left`) while the Draft batch of "a"
    waits for it: the batch runs at once, not at the end of the window."""

    async def scenario(draft, score, thread) -> None:
        first = asyncio.ensure_future(draft.submit(Step("a")))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        thread.session_left("b")
        await first
        assert time.monotonic() - began < 0.25

    assert two_phases(scenario) == [("Draft", ["a"])]


def score_batches(jury) -> float:
    return jury.servicer.metrics.registry.get_sample_value(
        "hydrajury_batch_calls_count", {"rpc": "Score"}
    )


def test_calls_arriving_while_another_service_holds_the_host_turn_join_one_batch(
    start_jury, tmp_path
):
    """Services sharing a host's cores take turns: a shard's batch waits while the trunk
    holds the turn, and is chosen once the turn is its own, so the calls that arrived
    meanwhile run in it."""
    from hydra_jury.serving.host_turn import HostTurn

    path = tmp_path / "host.turn"
    jury = start_jury(max_sessions=4, host_turn=path, batch_limits=BatchLimits(window_s=0))
    for session in ("a", "b"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    before = score_batches(jury)
    trunk = HostTurn(path)
    try:
        assert trunk.try_acquire()
        first = jury.stub.Score.future(score_request("a", 3), timeout=10)
        time.sleep(0.2)
        assert not first.done()  # its batch waits for the turn
        second = jury.stub.Score.future(score_request("b", 3), timeout=10)
        wait_until(lambda: jury.servicer.batchers["Score"].queued == 2)
        trunk.release()
        assert first.result().log_product.shape == second.result().log_product.shape
    finally:
        trunk.close()
    assert score_batches(jury) == before + 1


def test_the_window_lasts_while_another_service_holds_the_host_turn(start_jury, tmp_path):
    """Waiting for an expected session costs the host nothing while another service's
    batch runs: the window starts again once the turn is free. Here it would have ended
    while the trunk held the turn, and the second session come too late."""
    from hydra_jury.serving.host_turn import HostTurn

    path = tmp_path / "host.turn"
    jury = start_jury(max_sessions=4, host_turn=path, batch_limits=BatchLimits(window_s=0.3))
    for session in ("a", "b", "c"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("c", 3), [score_request("a", 3), score_request("b", 3)])
    before = score_batches(jury)
    trunk = HostTurn(path)
    try:
        assert trunk.try_acquire()
        first = jury.stub.Score.future(score_request("a", 3), timeout=10)
        time.sleep(0.6)  # two windows with the turn held
        trunk.release()
        time.sleep(0.1)
        jury.stub.Score(score_request("b", 3), timeout=10)
        first.result()
    finally:
        trunk.close()
    assert score_batches(jury) == before + 1


def test_the_window_starts_again_at_each_call_that_arrives(start_jury):
    """Sessions come back one after another: a batch waits for them as long as they
    keep arriving, each within a window of the one before (here the third arrives after
    the first's window)."""
    jury = start_jury(max_sessions=4, batch_limits=BatchLimits(window_s=0.3))
    for session in ("a", "b", "c", "d"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("d", 3), [score_request(s, 3) for s in ("a", "b", "c")])
    before = score_batches(jury)
    first = jury.stub.Score.future(score_request("a", 3), timeout=10)
    time.sleep(0.2)
    second = jury.stub.Score.future(score_request("b", 3), timeout=10)
    time.sleep(0.2)
    jury.stub.Score(score_request("c", 3), timeout=10)
    first.result(), second.result()
    assert score_batches(jury) == before + 1


def test_the_trunk_runs_at_once_while_a_shard_waits_with_calls_queued(start_trunk, tmp_path):
    """Sessions split into two groups, one's calls queued at the trunk and the other's
    at the shards, each waiting for the group the other holds, would wait out both
    windows and go round apart for good: the trunk does not wait while a shard waits with
    calls queued. Without that mark it waits out its window for the session it expects."""
    path = tmp_path / "host.turn"
    trunk = start_trunk(max_sessions=4, host_turn=path, batch_limits=BatchLimits(window_s=0.5))
    for session in ("a", "b", "c"):
        trunk.stub.Prefill(prefill_request(session), timeout=10)
    steps = [draft_request(session, draft_head="", gamma=1) for session in ("a", "b", "c")]
    batched(trunk, "Draft", steps[2], steps[:2])  # the next Draft batch expects 2 calls
    shard = TurnPeer(path, shared=True)
    try:
        shard.ask("mark_gathering")
        began = time.monotonic()
        trunk.stub.Draft(steps[0], timeout=10)
        assert time.monotonic() - began < 0.3
        shard.ask("unmark_gathering")
        began = time.monotonic()
        trunk.stub.Draft(steps[0], timeout=10)
        assert time.monotonic() - began >= 0.5
    finally:
        shard.close()


def test_a_shard_marks_that_it_waits_while_its_window_lasts(start_jury, tmp_path):
    path = tmp_path / "host.turn"
    jury = start_jury(max_sessions=4, host_turn=path, batch_limits=BatchLimits(window_s=1.0))
    for session in ("a", "b", "c"):
        jury.stub.Prefill(jury_prefill_request(session, 0, positions=3), timeout=10)
    batched(jury, "Score", score_request("c", 3), [score_request("a", 3), score_request("b", 3)])
    trunk = TurnPeer(path, shared=False)
    try:
        assert trunk.ask("yields") == "False"
        first = jury.stub.Score.future(score_request("a", 3), timeout=10)
        wait_until(lambda: trunk.ask("yields") == "True")  # "a" waits for "b"
        jury.stub.Score(score_request("b", 3), timeout=10)
        first.result()
        assert trunk.ask("yields") == "False"
    finally:
        trunk.close()
