"""The jury's score from its shards' partial scores equals the score of one jury hosting
every head: partials added, votes in checkpoint order whatever shard each juror is on."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.orchestrator.shard_scores import combine_shard_scores
from hydra_jury.workers.calls import ScoreCall
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests import calls

HEADS = ("head0", "head1", "head2", "head3")
# Interleaved, so that the shards' votes must be reordered.
SHARDS = (["head0", "head2"], ["head1", "head3"])


@pytest.mark.parametrize(
    ("jury", "amateur", "with_decision"),
    [(HEADS, None, True), (("head1", "head2", "head3"), "head0", False)],
    ids=["whole-jury-with-decision", "contrastive"],
)
def test_shards_combine_to_the_whole_jury(
    jury_model, jury_checkpoint, jury, amateur, with_decision
):
    limits = SessionLimits(1, 32)
    hidden = TrunkWorker(jury_model, limits=limits).prefill(calls.prefill("s", 0, [5, 6, 7, 9]))
    whole = JuryWorker(jury_model, limits=limits)
    shards = [
        JuryWorker(HydraModel.load(jury_checkpoint, heads=heads, load_trunk=False), limits=limits)
        for heads in SHARDS
    ]
    prompt, draft = hidden.tensor()[:2], hidden.tensor()[2:]
    call = ScoreCall(
        "s", 2, calls.hidden(draft), jury, 0.7, 0.5, with_decision=with_decision, amateur=amateur
    )
    parts = []
    for worker in [whole, *shards]:
        worker.prefill(calls.jury_prefill("s", 0, prompt))
        parts.append(worker.score(call))
    expected, combined = parts[0], combine_shard_scores(call, parts[1:], HEADS)

    assert combined.voters == expected.voters == jury
    assert torch.equal(combined.votes, expected.votes)
    torch.testing.assert_close(combined.log_product, expected.log_product, atol=1e-5, rtol=1e-5)
    if with_decision:
        torch.testing.assert_close(
            combined.decision_log_product, expected.decision_log_product, atol=1e-5, rtol=1e-5
        )
    else:
        assert combined.decision_log_product is None
    assert combined.head_evaluations == expected.head_evaluations
    if amateur is None:
        assert combined.amateur_logprobs is None
    else:
        torch.testing.assert_close(combined.amateur_logprobs, expected.amateur_logprobs)
