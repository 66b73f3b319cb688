"""Trunk and jury workers: the position rule, limits, idle eviction, drafter switching."""

from __future__ import annotations

import time

import pytest
import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.workers.calls import MAX_GAMMA, DraftCall
from hydra_jury.workers.errors import (
    CapacityError,
    InvalidArgument,
    PositionError,
    UnknownSessionError,
)
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests import calls

GREEDY = SamplingParams(temperature=0.0)


def test_position_rule_truncates_and_refuses_gaps(jury_model):
    trunk = TrunkWorker(jury_model, limits=SessionLimits(1, 32))
    trunk.prefill(calls.prefill("s", 0, torch.tensor([5, 6, 7])))
    first = trunk.draft(calls.draft("s", 3, 8, 3, "head0", GREEDY, 0))
    # Same call again: the cache is truncated to 3 first, so the result is identical.
    again = trunk.draft(calls.draft("s", 3, 8, 3, "head0", GREEDY, 0))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(
        first.hidden.tensor(), again.hidden.tensor()
    )
    with pytest.raises(PositionError, match="holds 6 positions of this session; cannot start at 7"):
        trunk.draft(calls.draft("s", 7, 8, 1, "head0", GREEDY, 0))
    with pytest.raises(UnknownSessionError):
        trunk.draft(calls.draft("other", 3, 8, 1, "head0", GREEDY, 0))


def test_draft_head_switch_catches_up_from_kept_hidden_states(jury_model):
    trunk = TrunkWorker(jury_model, limits=SessionLimits(2, 32))
    prompt = torch.tensor([5, 6, 7, 9, 10])
    for session in ("switch", "fresh"):
        trunk.prefill(calls.prefill(session, 0, prompt))
    trunk.draft(calls.draft("switch", 5, 11, 4, "head0", GREEDY, 0))
    switched = trunk.draft(calls.draft("switch", 5, 11, 4, "head2", GREEDY, 0))
    fresh = trunk.draft(calls.draft("fresh", 5, 11, 4, "head2", GREEDY, 0))
    assert torch.equal(switched.tokens, fresh.tokens)
    assert torch.allclose(switched.logprobs, fresh.logprobs, atol=1e-6)


def test_sessions_drafting_with_different_heads_share_one_lm_head_product(
    hydra_checkpoints, monkeypatch
):
    """A step of sessions drafting with different heads runs each head's layers over its
    sessions, and the shared LM head once over all their rows; each session drafts what
    it drafts alone."""
    from hydra_jury.hydra_model import HydraModel, heads

    model = HydraModel.load(hydra_checkpoints["qwen2"])  # tied: one LM head for all
    assert model.heads.shares_lm_head
    first, last = model.head_names[0], model.head_names[-1]
    trunk = TrunkWorker(model, limits=SessionLimits(3, 32))
    for session in ("a", "b", "c"):
        trunk.prefill(calls.prefill(session, 0, torch.tensor([5, 6, 7, 9, 10])))
    drafts = [
        calls.draft("a", 5, 11, 3, first, GREEDY, 0),
        calls.draft("b", 5, 11, 3, last, GREEDY, 0),
        calls.draft("c", 5, 12, 3, first, GREEDY, 0),
    ]
    alone = [trunk.draft(call) for call in drafts]
    products = []
    product = heads.shared_lm_head

    def counted(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        products.append(len(rows))
        return product(rows, weight)

    monkeypatch.setattr(heads, "shared_lm_head", counted)
    together = trunk.draft_batch(drafts)
    assert products == [3, 3, 3]  # one product a step, over the rows of both heads
    for one, joined in zip(alone, together, strict=True):
        assert torch.equal(one.tokens, joined.tokens)
        assert torch.allclose(one.logprobs, joined.logprobs, atol=1e-6)


def test_session_and_length_limits(jury_model):
    trunk = TrunkWorker(jury_model, limits=SessionLimits(1, 8))
    trunk.prefill(calls.prefill("a", 0, torch.tensor([5, 6])))
    with pytest.raises(CapacityError, match="all 1 sessions are in use"):
        trunk.prefill(calls.prefill("b", 0, torch.tensor([5])))
    with pytest.raises(CapacityError, match="over the limit of 8 tokens per session"):
        trunk.draft(calls.draft("a", 2, 6, 7, "head0", GREEDY, 0))
    assert trunk.release("a") and not trunk.release("a")
    with pytest.raises(CapacityError, match="over the limit of 8 tokens per session"):
        trunk.prefill(calls.prefill("b", 0, torch.arange(9)))
    assert len(trunk.sessions) == 0  # a refused call opens no session
    with pytest.raises(InvalidArgument, match="start: must be >= 0, got -1"):
        calls.prefill("b", -1, torch.tensor([5]))
    trunk.prefill(calls.prefill("b", 0, torch.tensor([5])))


def test_a_one_pass_check_runs_its_outside_drafts_in_one_trunk_step(jury_model):
    """A draft call of outside drafts, drafting nothing itself: one trunk step over the
    pending token and the drafts, the hidden states a prefill of those tokens gives.
    Refused where it would draft too, names a token outside the vocabulary or passes the
    session's length limit."""
    trunk = TrunkWorker(jury_model, limits=SessionLimits(2, 12))
    for session in ("check", "prefill"):
        trunk.prefill(calls.prefill(session, 0, torch.tensor([5, 6, 7])))
    steps = trunk.counters.trunk_calls
    result = trunk.draft(DraftCall("check", 3, 8, 1, None, GREEDY, 0, outside_drafts=(9, 10)))
    assert trunk.counters.trunk_calls - steps == 1
    assert result.tokens.numel() == 0 and result.logprobs is None
    assert result.hidden.rows == result.trunk_steps == 3
    expected = trunk.prefill(calls.prefill("prefill", 3, torch.tensor([8, 9, 10])))
    assert torch.equal(result.hidden.tensor(), expected.tensor())

    with pytest.raises(InvalidArgument, match="only a call that drafts nothing itself"):
        DraftCall("check", 3, 8, 1, "head0", GREEDY, 0, outside_drafts=(9,))
    with pytest.raises(InvalidArgument, match=f"outside_drafts: at most {MAX_GAMMA}"):
        DraftCall("check", 3, 8, 1, None, GREEDY, 0, outside_drafts=(9,) * (MAX_GAMMA + 1))
    with pytest.raises(InvalidArgument, match=r"outside_drafts\[1\]: token id 32 is outside"):
        trunk.draft(DraftCall("check", 6, 8, 1, None, GREEDY, 0, outside_drafts=(9, 32)))
    with pytest.raises(CapacityError, match="over the limit of 12 tokens per session"):
        trunk.draft(DraftCall("check", 6, 8, 1, None, GREEDY, 0, outside_drafts=(9,) * 6))
    # Refused calls touched nothing: the session still holds its 6 positions.
    again = trunk.draft(DraftCall("check", 6, 8, 1, None, GREEDY, 0, outside_drafts=(9,) * 5))
    assert again.hidden.rows == 6


def test_idle_sessions_are_evicted(jury_model):
    jury = JuryWorker(jury_model, limits=SessionLimits(1, 8, 0.05))
    hidden = torch.zeros(2, jury_model.config.hidden_size)
    jury.prefill(calls.jury_prefill("old", 0, hidden))
    time.sleep(0.1)
    jury.prefill(calls.jury_prefill("new", 0, hidden))  # the idle session made room
    assert len(jury.sessions) == 1
    with pytest.raises(UnknownSessionError):
        jury.score(calls.score("old", 2, hidden, ["head0"], 1.0, 1.0))


def test_score_returns_the_partial_product_of_the_requested_jurors(jury_model):
    jury = JuryWorker(jury_model, limits=SessionLimits(1, 16))
    tokens = torch.tensor([5, 6, 7, 8])
    hidden = jury_model.trunk.forward(tokens, jury_model.trunk_cache(16), 0)
    result = jury.score(calls.score("s", 0, hidden, ["head1", "head3"], 0.7, 2.0))
    logits = jury_model.heads.forward(hidden, jury_model.head_cache(4, 16), 0)
    shifted = [logits[i] / 0.7 - (logits[i] / 0.7).amax(-1, keepdim=True) for i in (1, 3)]
    assert torch.allclose(result.log_product, sum(2.0 * rows for rows in shifted), atol=1e-5)
    # The PoE target: the normalised sum of the jurors' log-probabilities times β.
    by_definition = sum(2.0 * torch.log_softmax(logits[i] / 0.7, -1) for i in (1, 3))
    target = torch.log_softmax(result.log_product, -1)
    assert torch.allclose(target, torch.log_softmax(by_definition, -1), atol=1e-5)
    assert result.voters == ("head1", "head3")
    assert torch.equal(result.votes, logits[[1, 3]].argmax(-1).T)
    with pytest.raises(InvalidArgument, match=r"jury: unknown heads \['head8'\]"):
        jury.score(calls.score("s", 0, hidden, ["head8"], 1.0, 1.0))


def test_a_batch_names_each_session_once(jury_model):
    trunk = TrunkWorker(jury_model, limits=SessionLimits(2, 32))
    jury = JuryWorker(jury_model, limits=SessionLimits(2, 32))
    twice = [calls.prefill("s", 0, [5, 6]), calls.prefill("s", 0, [7])]
    with pytest.raises(InvalidArgument, match="a session appears twice in one batch"):
        trunk.prefill_batch(twice)
    steps = [calls.draft("s", 0, 5, 1, None, GREEDY, 0)] * 2
    with pytest.raises(InvalidArgument, match="a session appears twice in one batch"):
        trunk.draft_batch(steps)
    hidden = torch.zeros(2, jury_model.config.hidden_size)
    scores = [calls.score("s", 0, hidden, ["head0"], 1.0, 1.0)] * 2
    with pytest.raises(InvalidArgument, match="a session appears twice in one batch"):
        jury.score_batch(scores)
    assert len(trunk.sessions) == len(jury.sessions) == 0  # refused before any session opened
