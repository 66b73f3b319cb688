"""The jury worker evaluates only the heads a call names; a head left out catches up from
the kept trunk outputs and then scores what a head that never left would have scored.

Catching up runs a head's positions in other batch shapes than a head that kept up, so
the logits agree to float32 rounding (tolerance 1e-5) and the votes exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hydra_jury.hydra_model import HeadStack, HydraModel
from hydra_jury.workers.calls import HiddenStates, JuryPrefillCall, ScoreCall
from hydra_jury.workers.errors import InvalidArgument, PositionError
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits

HEADS = ("head0", "head1", "head2", "head3")
PROMPT = [5, 6, 7, 9, 10, 11, 3]


@pytest.fixture(params=["own-lm-heads", "shared-lm-head"])
def model(request, jury_model) -> HydraModel:
    """The jury checkpoint (each head its own LM head), and the same heads sharing head0's
    LM head (one product for every head's rows, as with a tied embedding)."""
    if request.param == "own-lm-heads":
        return jury_model
    heads = jury_model.heads
    shared = HeadStack(heads.names, heads.layers, heads.norm, heads.lm_head[0], heads.rope)
    assert shared.shares_lm_head
    return dataclasses.replace(jury_model, heads=shared)


def trunk_outputs(model: HydraModel, count: int) -> torch.Tensor:
    tokens = torch.tensor((PROMPT * 4)[:count])
    return model.trunk.forward(tokens, model.trunk_cache(64), 0)  # [count, D]


def prefill(session: str, hidden: torch.Tensor, heads=(), start: int = 0) -> JuryPrefillCall:
    return JuryPrefillCall(session, start, HiddenStates(len(hidden), hidden), tuple(heads))


def score(session: str, start: int, hidden: torch.Tensor, jury, amateur=None) -> ScoreCall:
    rows = HiddenStates(len(hidden), hidden)
    return ScoreCall(session, start, rows, tuple(jury), 0.8, 1.5, True, amateur)


def assert_same_scores(got, expected) -> None:
    assert got.voters == expected.voters
    assert torch.equal(got.votes, expected.votes)
    torch.testing.assert_close(got.log_product, expected.log_product, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got.decision_log_product, expected.decision_log_product, rtol=1e-5, atol=1e-5
    )


def test_a_call_runs_only_the_heads_it_names(model):
    jury = JuryWorker(model, limits=SessionLimits(2, 64))
    hidden = trunk_outputs(model, 9)
    jury.prefill(prefill("s", hidden[:6], heads=["head1"]))
    assert jury.held_positions("s") == {"head0": 0, "head1": 6, "head2": 0, "head3": 0}
    result = jury.score(score("s", 6, hidden[6:], ["head1"]))
    assert result.voters == ("head1",) and result.head_evaluations == 3 * 1
    assert jury.held_positions("s") == {"head0": 0, "head1": 9, "head2": 0, "head3": 0}
    assert (jury.counters.head_positions, jury.counters.catch_up_positions) == (3, 6)
    assert jury.counters.head_runs == 2  # the prefill's head1, the score's head1
    # The amateur is evaluated too, and counted.
    contrastive = jury.score(score("s", 6, hidden[6:], ["head1"], amateur="head3"))
    assert contrastive.amateur_logprobs.shape == (3, model.config.vocab_size)
    assert contrastive.head_evaluations == 3 * 2
    assert jury.held_positions("s")["head3"] == 9


@pytest.mark.parametrize("juries", [[HEADS, ["head1"], ["head0", "head2", "head3"]]])
def test_heads_left_out_catch_up_to_what_fresh_sessions_score(model, juries):
    """One session scores with each jury in turn, three positions a turn; a fresh session
    per turn, prefilled with every head, scores the same positions with that jury."""
    jury = JuryWorker(model, limits=SessionLimits(2, 64))
    hidden = trunk_outputs(model, 4 + 3 * len(juries))
    jury.prefill(prefill("alternating", hidden[:4], heads=juries[0]))
    for turn, members in enumerate(juries):
        start = 4 + 3 * turn
        got = jury.score(score("alternating", start, hidden[start : start + 3], members))
        fresh = JuryWorker(model, limits=SessionLimits(1, 64))
        fresh.prefill(prefill("fresh", hidden[:start], heads=HEADS))
        expected = fresh.score(score("fresh", start, hidden[start : start + 3], members))
        assert_same_scores(got, expected)
        assert got.head_evaluations == 3 * len(members)


def test_a_rollback_is_never_caught_up_from_stale_positions(model):
    """head2 held positions 0..9 of a continuation that was rolled back to 6 and rewritten:
    when named again it recomputes from 6, from the new trunk outputs."""
    jury = JuryWorker(model, limits=SessionLimits(2, 64))
    old, new = trunk_outputs(model, 12), trunk_outputs(model, 12).flip(0)
    jury.prefill(prefill("s", old[:6], heads=HEADS))
    jury.score(score("s", 6, old[6:10], HEADS))
    jury.score(score("s", 6, new[6:9], ["head0"]))  # rewrites 6..8: head2 is cut to 6
    assert jury.held_positions("s")["head2"] == 6
    got = jury.score(score("s", 9, new[9:12], ["head2"]))
    fresh = JuryWorker(model, limits=SessionLimits(1, 64))
    fresh.prefill(prefill("f", torch.cat([old[:6], new[6:9]]), heads=HEADS))
    assert_same_scores(got, fresh.score(score("f", 9, new[9:12], ["head2"])))


def test_a_batch_of_different_juries_scores_each_call_as_alone(model):
    hidden = trunk_outputs(model, 10)
    plans = {  # session: (heads filled at prefill, jury, amateur)
        "a": (HEADS, ["head0", "head1"], None),
        "b": ((), ["head2"], "head1"),  # every head catches up
        "c": (["head3"], ["head1", "head2", "head3"], None),
        "d": (HEADS, ["head3"], None),
    }
    batched = JuryWorker(model, limits=SessionLimits(4, 64))
    for session, (filled, _, _) in plans.items():
        batched.prefill(prefill(session, hidden[:7], heads=filled))
    before = batched.counters.calls
    results = batched.score_batch(
        [score(s, 7, hidden[7:], jury, amateur) for s, (_, jury, amateur) in plans.items()]
    )
    assert batched.counters.calls == before + 1  # one forward for the whole batch
    for (session, (filled, members, amateur)), got in zip(plans.items(), results, strict=True):
        alone = JuryWorker(model, limits=SessionLimits(1, 64))
        alone.prefill(prefill(session, hidden[:7], heads=filled))
        expected = alone.score(score(session, 7, hidden[7:], members, amateur))
        assert_same_scores(got, expected)
        if amateur:
            torch.testing.assert_close(got.amateur_logprobs, expected.amateur_logprobs)


def test_the_position_rule_counts_the_kept_trunk_outputs(jury_model):
    """A prefill that fills no head still holds its positions: a score may start after
    them, never beyond."""
    jury = JuryWorker(jury_model, limits=SessionLimits(1, 64))
    hidden = trunk_outputs(jury_model, 8)
    jury.prefill(prefill("s", hidden[:5]))
    assert jury.counters.calls == 0  # nothing to run
    with pytest.raises(PositionError, match="the jury holds 5 positions"):
        jury.score(score("s", 6, hidden[6:], ["head0"]))
    assert jury.score(score("s", 5, hidden[5:], ["head0"])).head_evaluations == 3
    assert jury.counters.catch_up_positions == 5


def test_unknown_or_repeated_prefill_heads_are_refused(jury_model):
    jury = JuryWorker(jury_model, limits=SessionLimits(1, 64))
    hidden = trunk_outputs(jury_model, 4)
    with pytest.raises(InvalidArgument, match=r"heads: unknown heads \['head9'\]"):
        jury.prefill(prefill("s", hidden, heads=["head9"]))
    assert len(jury.sessions) == 0  # a refused call opens no session
    with pytest.raises(InvalidArgument, match="heads: a head is named twice"):
        prefill("s", hidden, heads=["head0", "head0"])
