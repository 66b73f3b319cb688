"""The draft scheduler without a server: calls join between steps and get what they get
alone, one call per session at a time (recognised by its ticket), a released session's
call fails alone, and a failing step fails its calls and lets their sessions go."""

from __future__ import annotations

import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.serving.batcher import CONTINUE
from hydra_jury.serving.draft_scheduler import DraftScheduler
from hydra_jury.workers.calls import DraftCall, DraftResult
from hydra_jury.workers.errors import InvalidArgument, UnknownSessionError
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests import calls

SAMPLED = SamplingParams(temperature=0.8, top_k=10)
PROMPT = [5, 6, 7, 9, 10]


def as_is(call: DraftCall) -> DraftCall:
    """Tickets here are the calls themselves (a service's are its requests)."""
    return call


def draft(session: str, gamma: int, draft_head: str | None = "head0") -> DraftCall:
    return calls.draft(session, len(PROMPT), 11, gamma, draft_head, SAMPLED, seed=3)


def worker_with(model, sessions: list[str], **options) -> TrunkWorker:
    worker = TrunkWorker(model, limits=SessionLimits(len(sessions), 32, **options))
    for session in sessions:
        worker.prefill(calls.prefill(session, 0, PROMPT))
    return worker


def test_calls_join_between_steps_and_get_what_they_get_alone(jury_model):
    worker = worker_with(jury_model, ["a", "b", "c"])
    scheduler = DraftScheduler(worker)
    a, b, c = draft("a", 3), draft("b", 2, "head2"), draft("c", 1, None)
    steps = worker.counters.trunk_calls
    assert scheduler.run([a], as_is) == [CONTINUE]
    assert scheduler.run([a, b, c], as_is)[:2] == [CONTINUE, CONTINUE]  # c: one step
    last = scheduler.run([a, b], as_is)
    assert worker.counters.trunk_calls - steps == 3 and len(scheduler) == 0

    alone = worker_with(jury_model, ["a", "b", "c"])
    for call, result in [(a, last[0]), (b, last[1])]:
        expected = alone.draft(call)
        assert isinstance(result, DraftResult)
        assert torch.equal(result.tokens, expected.tokens)
        torch.testing.assert_close(result.logprobs, expected.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            result.hidden.tensor(), expected.hidden.tensor(), atol=1e-5, rtol=1e-5
        )


def test_a_one_pass_check_shares_the_plain_steps_trunk_step(jury_model):
    """A one-pass check (outside drafts after the pending token) is a step like a plain
    one: both run in one trunk forward, ending in that batch with what each gets alone."""
    worker = worker_with(jury_model, ["a", "b"])
    scheduler = DraftScheduler(worker)
    plain = draft("a", 1, None)
    check = DraftCall("b", len(PROMPT), 11, 1, None, SAMPLED, 3, outside_drafts=(12, 13))
    steps = worker.counters.trunk_calls
    results = scheduler.run([plain, check], as_is)
    assert worker.counters.trunk_calls - steps == 1 and len(scheduler) == 0
    alone = worker_with(jury_model, ["a", "b"])
    for call, result in zip([plain, check], results, strict=True):
        expected = alone.draft(call)
        assert result.hidden.rows == expected.hidden.rows == 1 + len(call.outside_drafts)
        torch.testing.assert_close(
            result.hidden.tensor(), expected.hidden.tensor(), atol=1e-5, rtol=1e-5
        )


def test_a_plain_step_ends_in_its_first_batch(jury_model):
    worker = worker_with(jury_model, ["s"])
    (result,) = DraftScheduler(worker).run([draft("s", 1, None)], as_is)
    assert (result.trunk_steps, result.hidden.rows, len(result.tokens)) == (1, 1, 0)


def test_a_draft_model_call_runs_whole_in_its_first_batch(jury_model, draft_model):
    worker = TrunkWorker(jury_model, draft_model=draft_model, limits=SessionLimits(1, 32))
    worker.prefill(calls.prefill("s", 0, PROMPT))
    call = calls.model_draft("s", len(PROMPT), 11, 3, SAMPLED, 3)
    scheduler = DraftScheduler(worker)
    (result,) = scheduler.run([call], as_is)
    assert len(scheduler) == 0
    assert torch.equal(result.tokens, worker.draft(call).tokens)


def test_a_second_call_of_a_drafting_session_is_refused(jury_model):
    worker = worker_with(jury_model, ["s"])
    scheduler = DraftScheduler(worker)
    first, again = draft("s", 2), draft("s", 2)
    assert first == again and first is not again  # told apart by ticket, not by value
    assert scheduler.run([first], as_is) == [CONTINUE]
    result, refused = scheduler.run([first, again], as_is)
    assert len(result.tokens) == 2
    assert isinstance(refused, InvalidArgument)
    assert "session 's': another draft call of it is still running" in str(refused)


def test_a_call_that_cannot_start_fails_alone(jury_model):
    worker = worker_with(jury_model, ["s"])
    scheduler = DraftScheduler(worker)
    good = draft("s", 2)

    def decode(call: DraftCall) -> DraftCall:
        if call.session == "bad":
            raise InvalidArgument("sampling: required when drafting")
        return call

    assert scheduler.run([good], decode) == [CONTINUE]
    result, refused = scheduler.run([good, draft("bad", 1)], decode)
    assert len(result.tokens) == 2
    assert isinstance(refused, InvalidArgument) and "sampling" in str(refused)


def test_a_session_released_while_drafting_fails_its_call_alone(jury_model):
    worker = worker_with(jury_model, ["gone", "kept"])
    scheduler = DraftScheduler(worker)
    gone, kept = draft("gone", 3), draft("kept", 2)
    assert scheduler.run([gone, kept], as_is) == [CONTINUE, CONTINUE]
    worker.release("gone")
    lost, result = scheduler.run([gone, kept], as_is)
    assert isinstance(lost, UnknownSessionError)
    assert "session 'gone' was released while drafting" in str(lost)
    assert len(result.tokens) == 2 and len(scheduler) == 0


def test_a_failing_step_fails_its_calls_and_lets_their_sessions_go(jury_model, monkeypatch):
    worker = worker_with(jury_model, ["a", "b"], reclaim_after_s=0.0)
    scheduler = DraftScheduler(worker)
    a, b = draft("a", 3), draft("b", 2)
    assert scheduler.run([a], as_is) == [CONTINUE]
    failure = RuntimeError("the step failed")

    def fail(drafting) -> None:
        raise failure

    monkeypatch.setattr(worker, "draft_step", fail)
    assert scheduler.run([a, b], as_is) == [failure, failure]
    assert len(scheduler) == 0
    monkeypatch.undo()
    # Both were held (a drafting session is never reclaimed); let go, a newcomer takes
    # the slot of one of them instead of being refused.
    worker.prefill(calls.prefill("c", 0, PROMPT))
    assert len(worker.sessions) == 2
