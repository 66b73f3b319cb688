"""The single-process server's batchers (`serving.worker_batchers`): calls of different
sessions share a forward and get what they get alone, a long prefill runs in chunks,
and admission control refuses as the split services' does."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.serving.batcher import BatchLimits, QueueFull
from hydra_jury.serving.metrics import ServiceMetrics
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.worker_batchers import WorkerBatchers, prefill_chunks
from hydra_jury.workers.calls import PrefillCall
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests.grpc_stack import wait_for

HEADS = ("head0", "head1", "head2", "head3")


@pytest.fixture
def start(jury_model):
    """`start(limits)`: in-process batchers over fresh workers of the tiny jury model,
    with their metrics; closed after the test."""
    opened = []

    def started(limits: BatchLimits | None = None) -> tuple[WorkerBatchers, ServiceMetrics]:
        thread = ModelThread("test-model")
        session_limits = SessionLimits(max_sessions=8, max_session_tokens=128)
        trunk = TrunkWorker(jury_model, limits=session_limits)
        jury = JuryWorker(jury_model, limits=session_limits)
        metrics = ServiceMetrics()
        batchers = WorkerBatchers(trunk, jury, thread, limits, metrics)
        opened.append((batchers, thread))
        return batchers, metrics

    yield started
    for batchers, thread in opened:
        batchers.close()
        thread.shutdown()


def trunk_prefill(session: str, tokens: list[int], start: int = 0) -> PrefillCall:
    return PrefillCall(session, start, torch.tensor(tokens), HEADS)


def test_a_prompt_in_chunks_is_the_whole_prompt():
    call = trunk_prefill("s", list(range(3, 10)), start=2)
    chunks = prefill_chunks(call, 3)
    assert [(chunk.start, chunk.tokens.tolist()) for chunk in chunks] == [
        (2, [3, 4, 5]),
        (5, [6, 7, 8]),
        (8, [9]),
    ]
    assert all(chunk.heads == HEADS for chunk in chunks)
    assert prefill_chunks(call, 0) == [call] and prefill_chunks(call, 7) == [call]


def test_concurrent_prefills_share_a_forward_and_fill_what_they_fill_alone(start, jury_model):
    batchers, metrics = start()
    blocked = hold_model_thread(batchers)
    calls = [trunk_prefill(f"s{i}", list(range(3, 5 + i))) for i in range(4)]
    futures = [batchers.submit("Prefill", call) for call in calls]
    assert wait_for(lambda: batchers.batchers["Prefill"].queued == 4)
    blocked.set()
    outcomes = [future.result(timeout=30) for future in futures]
    assert [result for result, _ in outcomes] == [None] * 4
    assert batchers.batchers["Prefill"].largest == 4  # one batch of the four
    # Before the batcher has a cost line, a call's share of the batch is in proportion
    # to its positions (2, 3, 4 and 5).
    shares = [share for _, share in outcomes]
    assert shares[0] > 0
    for positions, share in zip([2, 3, 4, 5], shares, strict=True):
        assert share == pytest.approx(shares[0] * positions / 2, rel=1e-9)
    # Each session's trunk hidden states are the ones a lone forward gives.
    for call in calls:
        alone = jury_model.trunk.forward(call.tokens, jury_model.trunk_cache(len(call.tokens)), 0)
        held = batchers.trunk.sessions.peek(call.session).hidden
        torch.testing.assert_close(held[: len(call.tokens)], alone, atol=1e-5, rtol=1e-5)
    assert sample(metrics, "hydrajury_batch_calls_count", rpc="Prefill") == 2  # + the hold


def test_a_full_queue_refuses_at_once_with_a_retry_hint(start):
    batchers, metrics = start(BatchLimits(max_queue=2))
    blocked = hold_model_thread(batchers)
    running = batchers.submit("Prefill", trunk_prefill("a", [3, 4]))
    waiting = batchers.submit("Prefill", trunk_prefill("b", [3, 4]))
    assert wait_for(lambda: batchers.batchers["Prefill"].queued == 2)
    # Two wait behind the batch on the model thread; one more is refused at once.
    refused = batchers.submit("Prefill", trunk_prefill("c", [3, 4]))
    with pytest.raises(QueueFull, match=r"2 calls are queued \(the most is 2\); retry in about"):
        refused.result(timeout=10)
    blocked.set()
    assert running.result(timeout=30)[0] is None and waiting.result(timeout=30)[0] is None
    assert sample(metrics, "hydrajury_refused_calls_total", rpc="Prefill", reason="queue_full") == 1


def test_a_bad_call_fails_alone(start):
    batchers, _ = start()
    blocked = hold_model_thread(batchers)
    good = batchers.submit("Prefill", trunk_prefill("good", [3, 4, 5]))
    bad = batchers.submit("Prefill", trunk_prefill("bad", [3, 10_000]))  # not in the vocabulary
    assert wait_for(lambda: batchers.batchers["Prefill"].queued == 2)
    blocked.set()
    assert good.result(timeout=30)[0] is None
    with pytest.raises(Exception, match="tokens"):
        bad.result(timeout=30)
    assert batchers.trunk.sessions.peek("bad") is None  # a refused call opens no session


def test_a_call_is_told_when_its_batch_begins_on_the_model_thread(start):
    """`started` is set when the call's batch begins on the model thread, not while it
    queues behind another batch (`serve`'s rounds wait for it before their own work)."""
    batchers, _ = start()
    blocked = hold_model_thread(batchers)
    started = threading.Event()
    queued = batchers.submit("Prefill", trunk_prefill("a", [3, 4]), started)
    assert wait_for(lambda: batchers.batchers["Prefill"].queued == 1)
    assert not started.wait(0.2)
    blocked.set()
    assert started.wait(30)
    assert queued.result(timeout=30)[0] is None


def test_a_call_is_told_on_the_model_thread_before_its_batch_runs(start):
    """`started` is set by the model thread as the batch begins, not by the batching loop
    before it hands the batch over: the caller's own work, which waits for it, then
    finds the model thread already holding the interpreter for the batch."""
    batchers, _ = start()
    prefills = batchers.batchers["Prefill"]
    original = prefills.handle
    seen: dict[str, object] = {}

    class Recording(threading.Event):
        def set(self) -> None:
            seen["set_on"] = threading.get_ident()
            super().set()

    started = Recording()

    def handle(calls):
        seen["run_on"], seen["set_before"] = threading.get_ident(), started.is_set()
        return original(calls)

    prefills.handle = handle
    call = trunk_prefill("a", [3, 4])
    assert batchers.submit("Prefill", call, started).result(timeout=30)[0] is None
    assert seen["set_before"] is True
    assert seen["set_on"] == seen["run_on"] != threading.get_ident()


def hold_model_thread(batchers: WorkerBatchers) -> threading.Event:
    """Runs a batch that holds the model thread until the returned event is set, so that
    the calls submitted meanwhile queue behind it."""
    release = threading.Event()
    prefills = batchers.batchers["Prefill"]
    original = prefills.handle

    def held(calls):
        prefills.handle = original
        release.wait(30)
        return original(calls)

    prefills.handle = held
    batchers.submit("Prefill", trunk_prefill("hold", [3]))
    assert wait_for(lambda: prefills.running == 1)
    return release


def sample(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_batched_backend_tells_a_round_its_share_of_the_batches(jury_model):
    """The automatic drafter measures a round by its share (`LocalBackend` batched, as in
    `serve`): a call alone bears its whole batch, less than the time it waited for it."""
    thread = ModelThread("test-model")
    backend = LocalBackend(
        jury_model,
        limits=SessionLimits(max_sessions=4, max_session_tokens=64),
        thread=thread,
        batching=BatchLimits(),
    )
    try:
        with backend.sharing() as share:
            backend.prefill(trunk_prefill("s", [3, 4, 5]))
        assert 0 < share.share <= share.waited
        measured = (share.waited, share.share)
        backend.prefill(trunk_prefill("t", [3, 4, 5]))  # outside the scope: not counted
        assert (share.waited, share.share) == measured
    finally:
        backend.batchers.close()
        thread.shutdown()


def test_the_batches_stop_waiting_for_a_session_whose_generation_ended(jury_model):
    """Two generations in `serve`'s batched backend, one shorter: once it has ended, the
    other's steps run at once instead of waiting a batch window (1 s here) for it."""
    from hydra_jury.orchestrator.engine import Engine
    from hydra_jury.orchestrator.request import GenerationRequest

    thread = ModelThread("test-model")
    backend = LocalBackend(
        jury_model,
        limits=SessionLimits(max_sessions=4, max_session_tokens=128),
        thread=thread,
        batching=BatchLimits(window_s=1.0),
    )
    engine = Engine(backend, jury_model.load_tokenizer())

    def generate(tokens: int) -> float:
        request = GenerationRequest(
            prompt="Count the sheep.", max_new_tokens=tokens, ignore_eos=True, rule="verifier_only"
        )
        generation = engine.start(request)
        for _ in generation:
            pass
        return time.monotonic()

    try:
        with ThreadPoolExecutor(2) as pool:
            short, long = pool.submit(generate, 2), pool.submit(generate, 8)
            assert long.result(timeout=60) - short.result(timeout=60) < 0.9
    finally:
        backend.close()


def test_a_plain_step_goes_ahead_through_the_draft_batcher(jury_model):
    """`serve`'s backend sends a plain step ahead (the next step of a non-speculative
    round, once its token is drawn) to the Draft batcher: the same hidden state as the
    step made in turn. Head drafts, and a backend that does not batch, send nothing."""
    from hydra_jury.poe import SamplingParams
    from hydra_jury.workers.calls import DraftCall

    thread = ModelThread("test-model")
    limits = SessionLimits(max_sessions=4, max_session_tokens=64)
    backend = LocalBackend(jury_model, limits=limits, thread=thread, batching=BatchLimits())
    alone = LocalBackend(jury_model, limits=limits)
    try:
        steps = []
        for local, ahead in ((backend, True), (alone, False)):
            local.prefill(trunk_prefill("s", [3, 4, 5]))
            call = DraftCall("s", 3, 6, 1, None, SamplingParams(temperature=0.0), 0)
            future = local.draft_ahead(call)
            assert (future is not None) == ahead
            if ahead:
                sent = future
            steps.append(future.result(timeout=30)[0] if ahead else local.draft(call))
        torch.testing.assert_close(steps[0].hidden.tensor(), steps[1].hidden.tensor())
        # What the step cost comes with it, for the round that uses it: alone in its
        # batch, the whole batch, within the time from sending to the answer.
        cost = sent.result()[1]
        assert 0 < cost.share <= cost.waited
        with backend.sharing() as round_share:
            backend.count_ahead(cost)
        assert (round_share.waited, round_share.share) == (cost.waited, cost.share)
        head = DraftCall("s", 4, 7, 2, "head0", SamplingParams(temperature=0.0), 0)
        assert backend.draft_ahead(head) is None
        # The round goes on once its step has gone to the model thread, or after a batch
        # window when the thread is busy: never held up longer.
        release = hold_model_thread(backend.batchers)
        began = time.monotonic()
        waiting = backend.draft_ahead(DraftCall("s", 4, 7, 1, None, call.sampling, 0))
        assert BatchLimits().window_s <= time.monotonic() - began < 10
        assert not waiting.done()
        release.set()
        waiting.result(timeout=30)
    finally:
        backend.batchers.close()
        thread.shutdown()
