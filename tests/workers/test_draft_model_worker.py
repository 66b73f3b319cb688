"""The trunk worker's draft model: γ draft-model steps then one trunk forward over the
pending token and the drafts, caches that catch up on kept tokens and roll back by
length, and drafters' caches that never serve positions rewritten since."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.workers.calls import DraftCall
from hydra_jury.workers.errors import CapacityError, InvalidArgument
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests import calls
from tests.models import draft_model_logits

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 6, 7, 9, 10]


@pytest.fixture
def worker(jury_model, draft_model) -> TrunkWorker:
    return TrunkWorker(jury_model, draft_model=draft_model, limits=SessionLimits(2, 32))


def test_greedy_model_drafts_then_one_trunk_forward(worker, jury_model, draft_model):
    worker.prefill(calls.prefill("s", 0, PROMPT))
    before = (worker.counters.trunk_calls, worker.counters.draft_model_positions)
    result = worker.draft(calls.model_draft("s", 5, 11, 4, GREEDY, 0))
    context = [*PROMPT, 11]
    for token in result.tokens.tolist():  # each draft is the draft model's argmax
        assert token == int(draft_model_logits(draft_model, context).argmax())
        context.append(token)
    # One trunk call over the pending token and the 4 drafts; the draft model caught up
    # on the 5 prompt tokens and the pending one, then took 3 single steps.
    assert worker.counters.trunk_calls - before[0] == 1
    assert worker.counters.draft_model_positions - before[1] == 6 + 3
    assert (result.trunk_steps, result.head_evaluations) == (5, 0)
    assert result.hidden.rows == 5 and result.logprobs.shape == (4, 32)
    fresh = TrunkWorker(jury_model, limits=SessionLimits(1, 32))
    expected = fresh.prefill(calls.prefill("f", 0, context))
    torch.testing.assert_close(result.hidden.tensor(), expected.tensor()[5:])


def test_sampled_model_drafts_are_keyed_and_carry_their_distributions(worker, draft_model):
    sampling = SamplingParams(temperature=0.7)
    worker.prefill(calls.prefill("s", 0, PROMPT))
    first = worker.draft(calls.model_draft("s", 5, 11, 3, sampling, 42, with_decision=True))
    again = worker.draft(calls.model_draft("s", 5, 11, 3, sampling, 42, with_decision=True))
    assert torch.equal(first.tokens, again.tokens)  # keyed by (seed, position)
    context = [*PROMPT, 11]
    for row, token in enumerate(first.tokens.tolist()):
        logits = draft_model_logits(draft_model, context).float()
        torch.testing.assert_close(
            first.logprobs[row], torch.log_softmax(logits / 0.7, -1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            first.decision_logprobs[row], torch.log_softmax(logits, -1), atol=1e-5, rtol=1e-5
        )
        context.append(token)


def test_a_rejection_rolls_back_by_length_and_catches_up_on_kept_tokens(worker):
    """After a round that kept one draft and replaced the next, the draft model's cache
    is cut back to the committed tokens and runs only the new pending one: the result
    equals a fresh session's."""
    worker.prefill(calls.prefill("s", 0, PROMPT))
    first = worker.draft(calls.model_draft("s", 5, 11, 4, GREEDY, 0))
    kept = int(first.tokens[0])
    replacement = (int(first.tokens[1]) + 1) % 32
    before = worker.counters.draft_model_positions
    after_rejection = worker.draft(calls.model_draft("s", 7, replacement, 4, GREEDY, 0))
    assert worker.counters.draft_model_positions - before == 4  # no re-run of kept tokens
    worker.prefill(calls.prefill("fresh", 0, [*PROMPT, 11, kept]))
    fresh = worker.draft(calls.model_draft("fresh", 7, replacement, 4, GREEDY, 0))
    assert torch.equal(after_rejection.tokens, fresh.tokens)
    torch.testing.assert_close(after_rejection.logprobs, fresh.logprobs)


@pytest.mark.parametrize("drafter", ["model", "head1"])
def test_rewritten_positions_are_never_served_from_a_drafters_cache(worker, drafter):
    """A later turn that changes earlier tokens (a prefill from an earlier position)
    makes what the drafters' caches hold from there stale: they are cut back to it."""

    def draft(session: str, start: int) -> DraftCall:
        if drafter == "model":
            return calls.model_draft(session, start, 11, 3, GREEDY, 0)
        return calls.draft(session, start, 11, 3, drafter, GREEDY, 0)

    worker.prefill(calls.prefill("s", 0, PROMPT))
    worker.draft(draft("s", 5))  # the drafter's cache now holds positions 0..
    worker.prefill(calls.prefill("s", 2, [8, 8, 3]))  # a new turn: positions 2.. rewritten
    rewritten = worker.draft(draft("s", 5))
    worker.prefill(calls.prefill("fresh", 0, [5, 6, 8, 8, 3]))
    fresh = worker.draft(draft("fresh", 5))
    assert torch.equal(rewritten.tokens, fresh.tokens)
    torch.testing.assert_close(rewritten.logprobs, fresh.logprobs)


def test_bad_draft_model_calls_are_refused(worker, jury_model):
    with pytest.raises(InvalidArgument, match="must be empty when drafting with the draft model"):
        DraftCall("s", 0, 1, 2, "head0", GREEDY, 0, draft_model=True)
    without = TrunkWorker(jury_model, limits=SessionLimits(1, 32))
    without.prefill(calls.prefill("s", 0, PROMPT))
    with pytest.raises(InvalidArgument, match="hosts no draft model"):
        without.draft(calls.model_draft("s", 5, 11, 2, GREEDY, 0))
    worker.prefill(calls.prefill("s", 0, [*PROMPT] * 3))
    # 15 processed, then the pending token and 16 drafts: 32 positions fit, 33 do not.
    worker.draft(calls.model_draft("s", 15, 11, 16, GREEDY, 0))
    with pytest.raises(CapacityError, match="over the limit of 32 tokens"):
        worker.draft(calls.model_draft("s", 16, 11, 16, GREEDY, 0))
