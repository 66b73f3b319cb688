"""Sampling filters: top-k, top-p (nucleus), min-p and epsilon, on log-probabilities.

Terms
- kept / dropped: a dropped token gets log-probability -inf (probability 0); the kept
  ones are renormalised.
- top-k: keep the k most probable tokens. Ties at the boundary are broken by the lowest
  token id, so exactly k tokens are kept (the same tie rule as `torch.argmax`).
- top-p: keep the smallest set of most probable tokens whose mass is ≥ top_p, measured
  on the distribution left by top-k; the most probable token is always kept.
- min-p: drop the tokens whose probability is < min_p · (largest probability).
- epsilon: drop the tokens whose probability is < epsilon, an absolute floor measured on
  the distribution the filters above left (renormalised); the most probable token is
  always kept (epsilon sampling, Hewitt et al. 2022).

The filters run in that order, after temperature (and, for the target, after the
product): `filter_logprobs` is applied to the draft and to the target alike, so
speculative sampling is exact for the filtered target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hydra_jury.poe._checks import check_float
from hydra_jury.poe.target import log_softmax


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options. The defaults switch every filter off."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    epsilon: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first option out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(
                f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon must be in [0, 1) (0 = off), got {self.epsilon}")


def filter_logprobs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies top-k, then top-p, then min-p, then epsilon to each row and renormalises.

    logprobs: [N, V] normalised log-probabilities (temperature already applied).
    Returns [N, V] float32 log-probabilities, -inf where dropped; the input (as float32)
    when every filter is off.

    Example, probabilities [0.5, 0.3, 0.15, 0.05]:
      top_k=3 → [0.526, 0.316, 0.158, 0]; then top_p=0.82 → [0.625, 0.375, 0, 0]
      (0.526 + 0.316 ≥ 0.82, measured after top-k);
      min_p=0.2 alone → [0.526, 0.316, 0.158, 0] (0.05 < 0.2 · 0.5);
      epsilon=0.1 alone → [0.526, 0.316, 0.158, 0] (0.05 < 0.1); after top_k=2,
      epsilon=0.4 → [1, 0, 0, 0] (0.375 < 0.4 on the distribution top-k left).
    """
    check_float("logprobs", logprobs, dims=2)
    vocab_size = logprobs.shape[1]
    params.validate(vocab_size)
    logprobs = logprobs.float()
    top_k_on = 0 < params.top_k < vocab_size
    if not (top_k_on or params.top_p < 1 or params.min_p > 0 or params.epsilon > 0):
        return logprobs

    # One stable descending sort serves every filter; stability puts equal
    # probabilities in token-id order, which is the documented tie rule.
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)  # [N, V]
    ranks = torch.arange(vocab_size, device=logprobs.device)
    keep = torch.ones_like(sorted_logprobs, dtype=torch.bool)  # [N, V], in sorted order
    if top_k_on:
        keep &= ranks < params.top_k
    if params.top_p < 1:
        # Mass of the strictly more probable tokens, on the distribution top-k left.
        # Float64: the running sum is compared to top_p at every rank.
        kept_probs = _renormalised(sorted_logprobs, keep)
        mass_before = torch.cumsum(kept_probs, dim=-1) - kept_probs
        keep &= (mass_before < params.top_p) | (ranks == 0)
    if params.min_p > 0:
        # A ratio to the largest probability: unchanged by renormalisation.
        keep &= sorted_logprobs >= sorted_logprobs[:, :1] + math.log(params.min_p)
    if params.epsilon > 0:
        keep &= (_renormalised(sorted_logprobs, keep) >= params.epsilon) | (ranks == 0)
    keep_by_token = torch.zeros_like(keep).scatter(1, order, keep)
    return log_softmax(logprobs.masked_fill(~keep_by_token, -math.inf))


def _renormalised(sorted_logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[N, V] float64 probabilities of the kept tokens, renormalised (0 elsewhere)."""
    return F.softmax(sorted_logprobs.masked_fill(~keep, -math.inf), dim=-1).double()
