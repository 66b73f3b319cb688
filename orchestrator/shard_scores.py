"""The whole jury's score from its shards' partial scores.

Each jury shard scores a round with the jurors it hosts: its partial log-product and
their votes. The jury's result adds the partials in shard order (`poe.combine_partials`,
so the sum is deterministic) and puts the votes in checkpoint order, whatever shard each
juror sits on.
"""

from __future__ import annotations

import torch

from hydra_jury.poe import combine_partials
from hydra_jury.workers.calls import ScoreCall, ScoreResult


def combine_shard_scores(
    call: ScoreCall, parts: list[ScoreResult], head_names: tuple[str, ...]
) -> ScoreResult:
    """The result of `call` from each shard's result (`parts`, in shard order);
    `head_names` are the checkpoint's heads, in its order."""
    decision = None
    if call.with_decision:
        decision = combine_partials([part.decision_log_product for part in parts])
    voters = [voter for part in parts for voter in part.voters]
    order = sorted(range(len(voters)), key=lambda i: head_names.index(voters[i]))
    amateur = [part.amateur_logprobs for part in parts if part.amateur_logprobs is not None]
    return ScoreResult(
        combine_partials([part.log_product for part in parts]),
        decision,
        torch.cat([part.votes for part in parts], dim=1)[:, order],
        tuple(voters[i] for i in order),
        head_evaluations=sum(part.head_evaluations for part in parts),
        amateur_logprobs=amateur[0] if amateur else None,
    )
