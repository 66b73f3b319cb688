"""Calls and results survive the trip through the internal messages unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.protos.codec import CodecError
from hydra_jury.protos.hydrajury.v1 import internal_pb2
from hydra_jury.serving import internal_wire as wire
from hydra_jury.workers.calls import DraftResult, HiddenStates, ScoreResult
from hydra_jury.workers.errors import InvalidArgument
from tests import calls

SAMPLING = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, epsilon=0.01)


def test_trunk_calls_round_trip():
    prefill = calls.prefill("s", 3, [4, 5, 6])
    again = wire.prefill_call_from_pb(wire.prefill_call_to_pb(prefill))
    assert again.session == "s" and again.start == 3 and again.tokens.tolist() == [4, 5, 6]
    for draft_head, sampling in (("head1", SAMPLING), (None, SamplingParams())):
        draft = calls.draft(
            "s", 3, 9, 1 if draft_head is None else 4, draft_head, sampling, 7, True
        )
        assert wire.draft_call_from_pb(wire.draft_call_to_pb(draft)) == draft
    check = replace(calls.draft("s", 3, 9, 1, None, SamplingParams(), 7), outside_drafts=(4, 2))
    assert wire.draft_call_from_pb(wire.draft_call_to_pb(check)) == check


def test_a_draft_without_sampling_options_needs_no_draft_head():
    request = internal_pb2.DraftRequest(session="s", gamma=2, draft_head="head0")
    with pytest.raises(InvalidArgument, match="sampling: required when drafting"):
        wire.draft_call_from_pb(request)


def test_a_draft_result_must_hold_the_positions_of_its_call():
    """A one-pass check answered as a plain step (by a trunk service older than
    `outside_drafts`, one position) is a malformed response, not a round scored over the
    wrong positions."""
    check = replace(calls.draft("s", 3, 9, 1, None, SamplingParams(), 7), outside_drafts=(4, 2))
    no_tokens = torch.zeros(0, dtype=torch.long)
    plain = DraftResult(no_tokens, None, None, HiddenStates(1, torch.ones(1, 8)))
    with pytest.raises(CodecError, match="hidden: 1 positions, where the call runs 3"):
        wire.draft_result_from_pb(wire.draft_result_to_pb(plain), check, 6)
    three = replace(plain, hidden=HiddenStates(3, torch.ones(3, 8)))
    assert wire.draft_result_from_pb(wire.draft_result_to_pb(three), check, 6).hidden.rows == 3


def test_jury_calls_round_trip_and_hidden_states_pass_through_encoded():
    states = torch.randn(3, 8)
    score = calls.score("s", 2, states, ["head0", "head2"], 0.5, 2.0, True)
    request = wire.score_call_to_pb(score)
    decoded = wire.score_call_from_pb(request, "float32", 8)
    assert decoded.jury == ("head0", "head2") and decoded.beta == 2.0 and decoded.with_decision
    assert torch.equal(decoded.hidden.tensor(), states)
    # The orchestrator forwards the trunk's message without decoding it.
    forwarded = wire.forwarded_hidden(request.hidden)
    assert forwarded.rows == 3 and wire.hidden_to_pb(forwarded) is request.hidden
    with pytest.raises(TypeError, match="decode them at the service edge first"):
        forwarded.tensor()


def test_results_round_trip():
    hidden = HiddenStates(2, torch.randn(2, 8))
    draft = DraftResult(torch.tensor([3, 4]), torch.randn(2, 6), torch.randn(2, 6), hidden, 2, 2)
    call = calls.draft("s", 0, 1, 2, "head0", SAMPLING, 0, True)
    again = wire.draft_result_from_pb(wire.draft_result_to_pb(draft), call, 6)
    assert torch.equal(again.tokens, draft.tokens)
    assert torch.equal(again.logprobs, draft.logprobs)
    assert torch.equal(again.decision_logprobs, draft.decision_logprobs)
    assert again.hidden.rows == 2 and (again.trunk_steps, again.head_evaluations) == (2, 2)

    score = ScoreResult(torch.randn(2, 6), None, torch.tensor([[1, 2], [3, 4]]), ("h0", "h1"), 4)
    score_call = calls.score("s", 0, torch.zeros(2, 8), ["h0", "h1"], 1.0, 1.0)
    again = wire.score_result_from_pb(wire.score_result_to_pb(score), score_call, 6)
    assert torch.equal(again.log_product, score.log_product)
    assert again.decision_log_product is None
    assert torch.equal(again.votes, score.votes) and again.voters == ("h0", "h1")
