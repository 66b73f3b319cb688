"""Verification of a draft: how many of its tokens are kept, and what replaces the first
one that is not — greedy, sampled (speculative sampling with the rule's residual) and
coupled, as pure functions in the manner of a rejection sampler.

Terms (see `rules` for q, P, π and the residual)
- draft tokens x_1..x_k: drawn from q at positions p_1..p_k (the absolute positions the
  tokens will take); every random draw is keyed by (seed, position, purpose), so a
  verification repeats exactly wherever it runs.
- `Verification(accepted, replacement)`: the leading `accepted` draft tokens are kept;
  `replacement` is the token at position p_(accepted+1), None when all k are kept.

Shapes: k draft tokens, `Distributions` of k rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.poe.filters import SamplingParams, filter_logprobs
from hydra_jury.poe.randomness import categorical, uniforms
from hydra_jury.poe.rules import (
    Distributions,
    acceptance_probs,
    greedy_tokens,
    greedy_verdict,
    residual_probs,
    rule_target,
)
from hydra_jury.poe.target import probabilities


@dataclass(frozen=True)
class Verification:
    accepted: int  # leading draft tokens kept
    replacement: int | None  # the token at the first rejected position; None: all kept


def verify_greedy(
    rule: str, lenience: float, draft_tokens: torch.Tensor, probs: Distributions
) -> Verification:
    """Greedy (T = 0): each draft token against the argmax of the rule's target
    (`rules.greedy_verdict`); the replacement is that argmax."""
    accepted, replacements = greedy_verdict(rule, lenience, draft_tokens, probs)
    kept = leading_true(accepted)
    return Verification(kept, int(replacements[kept]) if kept < len(draft_tokens) else None)


def verify_sampled(
    rule: str,
    lenience: float,
    draft_tokens: torch.Tensor,
    probs: Distributions,
    seed: int,
    positions: torch.Tensor,
) -> Verification:
    """Speculative sampling: x_i is kept when u_i < `acceptance_probs` (u keyed by its
    position, purpose "accept"), left to right; the first rejected position's token is
    drawn from the rule's residual (purpose "residual"). The emitted tokens follow π
    exactly for every rule but `lenient`."""
    keep = acceptance_probs(rule, lenience, probs, draft_tokens)
    kept = leading_true(uniforms(seed, positions, "accept") < keep.double())
    if kept == len(draft_tokens):
        return Verification(kept, None)
    residual = residual_probs(rule, lenience, probs.row(kept))
    replacement = categorical(residual, seed, positions[kept : kept + 1], "residual")
    return Verification(kept, int(replacement[0]))


def verify_coupled(
    rule: str,
    lenience: float,
    draft_tokens: torch.Tensor,
    probs: Distributions,
    seed: int,
    positions: torch.Tensor,
) -> Verification:
    """Verification by coupling: at each position, the token a plain step would draw
    there — from π, keyed by the position, purpose "sample" — is compared with the draft
    token; drafts are kept while they are equal, and the first draw that differs is the
    replacement. Every emitted token is that draw, so the tokens are the very tokens of
    drawing from π without drafting (for `exact`: non-speculative PoE with the same
    seed), whatever was drafted; the rule is exact for any q. For a point mass (n-gram
    drafts) it is also the best acceptance: x is kept with probability π(x) = min(1,
    π(x)/q(x)). For a full q it keeps x with probability π(x), less than min(1,
    π(x)/q(x)). `lenient` keeps more than π(x) and must use `verify_sampled`."""
    draws = categorical(rule_target(rule, lenience, probs), seed, positions, "sample")
    kept = leading_true(draws == draft_tokens)
    return Verification(kept, int(draws[kept]) if kept < len(draft_tokens) else None)


def draw_token(
    logprobs: torch.Tensor,
    sampling: SamplingParams,
    seed: int,
    position: int,
    purpose: str,
    probs: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor]:
    """One token for `position` from the row `logprobs` [1, V]: its argmax when greedy
    (`greedy_tokens`; the filters never move it), else a draw keyed by (seed, position,
    purpose) from the filtered distribution. Returns the token and the log-probabilities
    it was chosen from ([1, V]: filtered, unless greedy). `probs`: `probabilities(logprobs)`
    where the caller has them already."""
    if sampling.greedy:
        probs = probabilities(logprobs) if probs is None else probs
        return int(greedy_tokens(probs)[0]), logprobs
    filtered = filter_logprobs(logprobs, sampling)
    if probs is None or filtered is not logprobs:  # no filter on: the caller's rows serve
        probs = probabilities(filtered)
    token = categorical(probs, seed, torch.tensor([position]), purpose)
    return int(token[0]), filtered


def leading_true(mask: torch.Tensor) -> int:
    """Number of leading True values: [T, T, F, T] → 2."""
    return int(mask.to(torch.int64).cumprod(0).sum())
