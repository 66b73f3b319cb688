"""A session's chain of plain steps (`serving.plain_chain`): each step's token is the
plain step's draw, the chain moves to the next position, and it stops by itself at its
last step, at a stop token and when the session falls behind; stopped or failed, the
steps it did not run answer so."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.poe import SamplingParams, draw_token, target_rows
from hydra_jury.serving.plain_chain import MAX_UNTAKEN, ChainScoring, PlainChain
from hydra_jury.workers.calls import DraftCall, DraftResult, HiddenStates, ScoreResult

VOCAB = 16
GREEDY = SamplingParams(temperature=0.0)


def chain(steps: int = 8, stop_tokens: frozenset[int] = frozenset(), **sampling) -> PlainChain:
    params = SamplingParams(**sampling) if sampling else GREEDY
    call = DraftCall("s", 5, 3, 1, None, params, 11)
    scoring = ChainScoring(("head0", "head1"), params.temperature, 1.0, params, 11)
    return PlainChain(call, scoring, steps, stop_tokens)


def results(best: int, generator: torch.Generator | None = None) -> tuple:
    """A step's draft and score whose target's most likely token is `best`."""
    log_product = torch.randn(1, VOCAB, generator=generator)
    log_product[0, best] = log_product.max() + 1.0
    score = ScoreResult(log_product, None, torch.zeros(1, 2, dtype=torch.long), ("h0", "h1"))
    draft = DraftResult(torch.zeros(0, dtype=torch.long), None, None, HiddenStates(1, None))
    return draft, score


def test_a_step_draws_the_plain_steps_token_and_the_chain_moves_on():
    plain = chain(temperature=0.9, top_k=8)
    generator = torch.Generator().manual_seed(0)
    for index in range(4):
        draft, score = results(index + 2, generator)
        start = plain.call.start
        assert plain.publish(draft, score, 0.01, 0.005)
        step = plain.step(index).result(timeout=1)
        target = target_rows(score.log_product)
        expected, _ = draw_token(
            target.logprobs, plain.scoring.sampling, 11, start + 1, "sample", target.probs
        )
        assert step.token == expected
        assert (step.seconds, step.share) == (0.01, 0.005)
        torch.testing.assert_close(step.target.logprobs, target.logprobs)
        # The next step runs the token just drawn, one position on.
        assert (plain.call.start, plain.call.pending) == (start + 1, step.token)
    call = plain.score_call(HiddenStates(1, torch.zeros(1, 4)))
    assert (call.session, call.start, call.jury) == ("s", plain.call.start, ("head0", "head1"))


def test_it_stops_after_its_last_step_and_at_a_stop_token():
    limited = chain(steps=2)
    assert limited.publish(*results(4), 0, 0)
    limited.step(1)
    assert not limited.publish(*results(4), 0, 0)  # its second and last step
    assert limited.stopped and limited.step(2).result(timeout=1) is None

    stopping = chain(stop_tokens=frozenset({7}))
    assert stopping.publish(*results(6), 0, 0)
    assert not stopping.publish(*results(7), 0, 0)
    assert stopping.step(1).result(timeout=1).token == 7
    assert stopping.step(2).result(timeout=1) is None


def test_it_stops_when_the_session_falls_behind():
    behind = chain()
    assert all(behind.publish(*results(4), 0, 0) for _ in range(MAX_UNTAKEN))
    assert not behind.publish(*results(4), 0, 0)  # none taken: one step too many ahead
    assert behind.step(MAX_UNTAKEN + 1).result(timeout=1) is None

    keeping_up = chain()
    for index in range(2 * MAX_UNTAKEN):
        keeping_up.step(index)  # the session waits for each step as it comes
        assert keeping_up.publish(*results(4), 0, 0)


def test_stopped_or_failed_the_steps_not_run_answer_so():
    stopped = chain()
    waiting = stopped.step(0)
    stopped.stop()
    assert waiting.result(timeout=1) is None and stopped.step(3).result(timeout=1) is None
    assert not stopped.publish(*results(4), 0, 0)  # a step running as it was stopped

    failed = chain()
    assert failed.publish(*results(4), 0, 0)
    waiting = failed.step(1)
    failed.fail(RuntimeError("the trunk failed"))
    assert failed.step(0).result(timeout=1).token == 4  # what it ran stays
    for future in (waiting, failed.step(2)):
        with pytest.raises(RuntimeError, match="the trunk failed"):
            future.result(timeout=1)


def test_a_chain_runs_plain_steps_only():
    scoring = ChainScoring(("head0",), 0.0, 1.0, GREEDY, 0)
    for call in (
        DraftCall("s", 5, 3, 2, "head0", GREEDY, 0),
        DraftCall("s", 5, 3, 1, None, GREEDY, 0, outside_drafts=(4,)),
    ):
        with pytest.raises(ValueError, match="plain steps only"):
            PlainChain(call, scoring, 4, frozenset())
    with pytest.raises(ValueError, match="at least one step"):
        PlainChain(DraftCall("s", 5, 3, 1, None, GREEDY, 0), scoring, 0, frozenset())
