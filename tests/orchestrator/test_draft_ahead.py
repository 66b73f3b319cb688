"""When a pipelined round sends the next round's draft ahead (`AheadPolicy`): when the
draft kept on average saves more than a discarded one makes the next round wait."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from hydra_jury.orchestrator.draft_ahead import AheadPolicy, DraftAhead
from hydra_jury.poe import SamplingParams
from hydra_jury.workers.calls import DraftCall


def measured(draft_s: float, score_s: float, kept_all: list[bool]) -> AheadPolicy:
    policy = AheadPolicy()
    for kept in kept_all:
        policy.observe_draft(draft_s)
        policy.observe_score(score_s)
        policy.observe_round(kept)
    return policy


def test_nothing_is_sent_ahead_before_the_draft_and_the_score_are_measured():
    assert not AheadPolicy().pays()
    assert AheadPolicy().kept_all_rate == pytest.approx(0.5)
    policy = AheadPolicy()
    policy.observe_draft(0.04)
    assert not policy.pays()
    policy.observe_score(0.05)
    assert policy.pays()


def test_a_request_starts_from_what_earlier_requests_measured():
    pool = AheadPolicy.pooled()
    assert not pool.starting().pays()
    first = pool.starting()
    for index in range(30):  # a draft 4 times the score, every second round kept
        first.observe_draft(0.2)
        first.observe_score(0.05)
        first.observe_round(kept_all=index % 2 == 0)
    second = pool.starting()
    assert (second.draft_s, second.score_s) == pytest.approx((0.2, 0.05), rel=0.01)
    assert second.rounds == 2.0 and 0.3 < second.kept_all_rate < 0.7
    assert not second.pays()  # it has not measured a round, but knows it does not pay
    for _ in range(8):
        second.observe_round(kept_all=True)
    assert second.pays()  # its own rounds decide soon
    assert 0.3 < pool.kept_all_rate < 0.7  # the pool remembers longer


@pytest.mark.parametrize(
    ("draft_s", "score_s", "kept_all", "pays"),
    [
        # A draft no longer than the score: a discarded one costs nothing.
        (0.05, 0.05, [False] * 20, True),
        (0.04, 0.05, [True, False] * 10, True),
        # A draft 4 times the score (γ = 4 on a CPU): pays from p > 0.75.
        (0.2, 0.05, [True] * 20, True),
        (0.2, 0.05, [True, True, True, False] * 5, False),  # p ≈ 0.7 (decayed)
        (0.2, 0.05, [True, False] * 10, False),
        # The trained demo's heads at γ = 2: a draft twice the score, p ≈ 0.6.
        (0.1, 0.05, [True, True, False] * 7, True),
    ],
)
def test_it_pays_when_the_overlap_kept_outweighs_the_wait_discarded(
    draft_s, score_s, kept_all, pays
):
    policy = measured(draft_s, score_s, kept_all)
    p = policy.kept_all_rate
    gain, loss = p * min(score_s, draft_s), (1 - p) * max(draft_s - score_s, 0)
    assert policy.pays() is pays is (gain > loss)


def test_the_last_rounds_decide():
    policy = measured(0.2, 0.05, [False] * 20)
    assert not policy.pays()
    for _ in range(12):
        policy.observe_round(True)
    assert policy.pays()


def test_a_draft_sent_ahead_times_itself():
    future: Future = Future()
    call = DraftCall("s", 3, 7, 2, "head0", SamplingParams(), 0)
    ahead = DraftAhead(call, future)
    time.sleep(0.02)
    future.set_result(None)
    seconds = ahead.seconds
    time.sleep(0.02)
    assert 0.02 <= seconds == ahead.seconds < 0.04
