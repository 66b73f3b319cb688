"""What a round reads of its target rows, computed together: log P (the jury's
log-product normalised), P (`probabilities`), and per row the entropy, the stability
margin and the greedy token.

The kernels compute them in one call (`poe.row_kernels`), each the bits its own function
gives; without them, those functions one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.poe._checks import as_float32, check_float
from hydra_jury.poe.metrics import entropy, stability_margin
from hydra_jury.poe.row_kernels import row_kernels
from hydra_jury.poe.rules import greedy_tokens
from hydra_jury.poe.target import normalise_logprobs, probabilities


@dataclass(frozen=True)
class TargetRows:
    logprobs: torch.Tensor  # [N, V] float32 log P
    probs: torch.Tensor  # [N, V] float32 P, `probabilities(logprobs)`
    entropy: torch.Tensor  # [N] float32 nats
    margin: torch.Tensor  # [N] float32 stability margin
    greedy: torch.Tensor  # [N] long, `greedy_tokens(probs)`


def target_rows(log_product: torch.Tensor) -> TargetRows:
    """log_product: [N, V], the jury's unnormalised log-product → its `TargetRows`."""
    check_float("log_product", log_product, dims=2)
    rows = as_float32(log_product)
    ops = row_kernels(rows)
    if ops is not None:
        return TargetRows(*ops.target_rows(rows))
    logprobs = normalise_logprobs(rows)
    probs = probabilities(logprobs)
    return TargetRows(
        logprobs, probs, entropy(probs, logprobs), stability_margin(logprobs), greedy_tokens(probs)
    )
