"""Contrastive decoding: the expert's log-probabilities minus the amateur's, on the tokens
the expert finds plausible (Li et al. 2023, "Contrastive Decoding").

Terms
- expert: here the PoE jury, P; amateur: one head, p_a, at the same temperature.
- plausible set: {x : P(x) ≥ α · max P}, α in (0, 1]; outside it a token scores -inf, so
  the amateur can neither promote a token the expert finds implausible nor demote the
  expert's clear favourite below it.
- contrastive score: log P(x) − log p_a(x) on the plausible set. Greedy decoding takes
  its argmax; sampling draws from softmax(score) (after the usual filters).

Shapes: N positions, V vocabulary.
"""

from __future__ import annotations

import math

import torch

from hydra_jury.poe._checks import check_float, check_same_shape
from hydra_jury.poe.target import log_softmax


def validate_alpha(alpha: float) -> None:
    if not (isinstance(alpha, int | float) and 0 < alpha <= 1):
        raise ValueError(f"contrastive_alpha must be in (0, 1], got {alpha!r}")


def contrastive_logprobs(
    expert_logprobs: torch.Tensor, amateur_logprobs: torch.Tensor, alpha: float
) -> torch.Tensor:
    """expert_logprobs, amateur_logprobs: [N, V] normalised → [N, V] float32, the
    log-softmax of the contrastive scores, -inf outside the plausible set.

    Example: P = [0.6, 0.3, 0.1], p_a = [0.7, 0.1, 0.2], α = 0.2 → plausible {0, 1}
    (0.1 < 0.2 · 0.6), scores [log(6/7), log 3, -inf] → probabilities [0.222, 0.778, 0].
    """
    check_float("expert_logprobs", expert_logprobs, dims=2)
    check_float("amateur_logprobs", amateur_logprobs, dims=2)
    check_same_shape("expert_logprobs", expert_logprobs, amateur_logprobs=amateur_logprobs)
    validate_alpha(alpha)
    expert, amateur = expert_logprobs.float(), amateur_logprobs.float()
    plausible = expert >= expert.amax(dim=-1, keepdim=True) + math.log(alpha)  # [N, V]
    scores = (expert - amateur).masked_fill(~plausible, -math.inf)
    return log_softmax(scores)
