"""Acceptance rules: how a drafted token is verified, and what replaces it when it is not.

Terms
- draft token x: the token the draft head proposed at a position, drawn from q.
- q (`Distributions.draft`): the draft distribution; P (`Distributions.target`): the
  jury's target. Both tempered and filtered, as the tokens are sampled from them.
- decision distributions (`Distributions.decision_draft`, `.decision_target`): q and P
  at temperature 1 without filters. The cascade rules decide on these, so that the
  deferral decision does not move with the sampling settings.
- lenience λ: how much quality a rule may trade for acceptance. Its range depends on
  the rule (see `validate_rule`).
- deferral decision: a cascade rule's choice, per position (chow, diff, opt) or per
  token (token_v1/v2/v3), between the drafter q and the jury P.
- effective target π: the distribution a rule samples exactly (`rule_target`).
- accepted: the draft token is kept, with probability `acceptance_probs`.
- residual: the distribution a replacement is drawn from after a rejection,
  normalise(max(0, π − q)); sampling x ~ q, keeping it with min(1, π(x)/q(x)) and
  otherwise drawing from the residual gives exactly π.
- replacement: the token emitted at the first rejected position.

| rule | π | acceptance |
| --- | --- | --- |
| exact, verifier_only | P | min(1, π(x)/q(x)) |
| lenient | P | min(1, P(x)/((1−λ)·q(x))): lossy, the output is not P |
| cascade_chow | q if max q_dec ≥ 1 − λ, else P | min(1, π(x)/q(x)) |
| cascade_diff | q if max q_dec ≥ max P_dec − λ, else P | as above |
| cascade_opt | q if max q_dec ≥ max P_dec − λ·TV(q_dec, P_dec), else P | as above |
| cascade_token_v1 | q·1_A + (1 − Σ_A q)·P, A = {v : q_dec(v) ≥ max P_dec − λ} | as above |
| cascade_token_v2 | as v1, A = {v : P_dec(v) ≥ max P_dec − λ} | as above |
| cascade_token_v3 | as v1, A = {v : P_dec(v) ≥ (1 − λ)·max P_dec} | as above |
| drafter_only | q | 1 |

TV(a, b) = Σ max(0, a − b). `verifier_only` is non-speculative PoE: the engine samples
from P without drafting. Should it be passed here, it behaves exactly as `exact`.

Shapes: B rows (the engine passes the γ positions of a round), V vocabulary.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import StrEnum

import torch

from hydra_jury.poe._checks import check_float, check_long, check_rows, check_same_shape
from hydra_jury.poe.maxima import first_argmax


class Rule(StrEnum):
    """The acceptance rules; each is its name, so `Rule.EXACT == "exact"`."""

    EXACT = "exact"
    LENIENT = "lenient"
    CASCADE_CHOW = "cascade_chow"
    CASCADE_DIFF = "cascade_diff"
    CASCADE_OPT = "cascade_opt"
    CASCADE_TOKEN_V1 = "cascade_token_v1"
    CASCADE_TOKEN_V2 = "cascade_token_v2"
    CASCADE_TOKEN_V3 = "cascade_token_v3"
    DRAFTER_ONLY = "drafter_only"
    VERIFIER_ONLY = "verifier_only"

    @property
    def is_cascade(self) -> bool:
        """Cascades decide on the temperature-1 unfiltered distributions."""
        return self in _CASCADES


_CASCADES = frozenset(
    {
        Rule.CASCADE_CHOW,
        Rule.CASCADE_DIFF,
        Rule.CASCADE_OPT,
        Rule.CASCADE_TOKEN_V1,
        Rule.CASCADE_TOKEN_V2,
        Rule.CASCADE_TOKEN_V3,
    }
)
RULES: tuple[str, ...] = tuple(rule.value for rule in Rule)

# Below this residual mass, normalise(max(0, π − q)) is rounding noise: π ≈ q, so a
# rejection has probability ≤ this mass, and drawing from π instead changes the output
# distribution by at most that much in total variation.
_MIN_RESIDUAL_MASS = 1e-6


def validate_rule(rule: str, lenience: float) -> Rule:
    """The rule named `rule`; raises ValueError for an unknown rule or a lenience outside
    the rule's range.

    Ranges: `lenient` 0 ≤ λ < 1 (λ = 1 would accept everything with no correction);
    every other rule 0 ≤ λ ≤ 1. `exact`, `drafter_only` and `verifier_only` ignore λ.
    `cascade_opt` stops at 1 too: max P − TV ≤ q(argmax P) ≤ max q always holds, so
    λ = 1 already defers every position to the drafter (up to float rounding) and larger
    values change nothing.
    """
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of {', '.join(RULES)}")
    if not isinstance(lenience, numbers.Real) or not math.isfinite(lenience):
        raise ValueError(f"lenience must be a finite number, got {lenience!r}")
    if rule == Rule.LENIENT:
        if not 0 <= lenience < 1:
            raise ValueError(f"rule 'lenient' needs 0 <= lenience < 1, got {lenience}")
    elif not 0 <= lenience <= 1:
        raise ValueError(f"rule {str(rule)!r} needs 0 <= lenience <= 1, got {lenience}")
    return Rule(rule)


@dataclass(frozen=True)
class Distributions:
    """The draft q and the target P at the B positions one verification decides on,
    each [B, V] (float32 once built).

    draft, target: tempered and filtered, as the tokens are sampled from them.
    decision_draft, decision_target: temperature 1 and unfiltered, what the cascade rules
    defer on; left out (None), they are the sampled ones.
    """

    draft: torch.Tensor
    target: torch.Tensor
    decision_draft: torch.Tensor | None = None
    decision_target: torch.Tensor | None = None

    def __post_init__(self) -> None:
        named = {
            "draft": self.draft,
            "target": self.target,
            "decision_draft": self.draft if self.decision_draft is None else self.decision_draft,
            "decision_target": (
                self.target if self.decision_target is None else self.decision_target
            ),
        }
        for name, tensor in named.items():
            check_float(name, tensor, dims=2)
            check_same_shape("draft", self.draft, **{name: tensor})
            object.__setattr__(self, name, tensor.float())

    @property
    def rows(self) -> int:
        return self.draft.shape[0]

    def row(self, index: int) -> Distributions:
        """The distributions of row `index` alone ([1, V] each)."""
        pick = slice(index, index + 1)
        return Distributions(
            self.draft[pick],
            self.target[pick],
            self.decision_draft[pick],
            self.decision_target[pick],
        )


def rule_target(rule: str, lenience: float, probs: Distributions) -> torch.Tensor:
    """The rule's effective target π: [B, V] float32 (table in the module docstring),
    built from the sampled q and P, its deferral decisions taken on the decision ones."""
    rule = validate_rule(rule, lenience)
    if rule in (Rule.EXACT, Rule.LENIENT, Rule.VERIFIER_ONLY):
        return probs.target
    if rule == Rule.DRAFTER_ONLY:
        return probs.draft

    decision_draft, decision_target = probs.decision_draft, probs.decision_target
    max_draft = decision_draft.amax(dim=-1, keepdim=True)  # [B, 1]
    max_target = decision_target.amax(dim=-1, keepdim=True)  # [B, 1]
    if rule in (Rule.CASCADE_CHOW, Rule.CASCADE_DIFF, Rule.CASCADE_OPT):
        if rule == Rule.CASCADE_CHOW:
            threshold = torch.full_like(max_draft, 1 - lenience)
        elif rule == Rule.CASCADE_DIFF:
            threshold = max_target - lenience
        else:
            total_variation = (decision_draft - decision_target).clamp(min=0)
            threshold = max_target - lenience * total_variation.sum(dim=-1, keepdim=True)
        defer_to_draft = max_draft >= threshold  # [B, 1]
        return torch.where(defer_to_draft, probs.draft, probs.target)

    if rule == Rule.CASCADE_TOKEN_V1:
        draft_set = decision_draft >= max_target - lenience  # [B, V]
    elif rule == Rule.CASCADE_TOKEN_V2:
        draft_set = decision_target >= max_target - lenience
    else:
        draft_set = decision_target >= (1 - lenience) * max_target
    draft_part = probs.draft * draft_set  # [B, V]
    # Clamped: the draft mass inside the set can round to a hair above 1.
    target_weight = (1 - draft_part.sum(dim=-1, keepdim=True)).clamp(min=0)  # [B, 1]
    return draft_part + target_weight * probs.target


def acceptance_probs(
    rule: str, lenience: float, probs: Distributions, draft_tokens: torch.Tensor
) -> torch.Tensor:
    """Probability of keeping each draft token: [B] float32 in [0, 1].

    draft_tokens: [B] long, the tokens drawn from `probs.draft`. A draft token with
    q(x) = 0 cannot have been drawn from q; it gets probability 0 (rejected, the residual
    then samples π) rather than a NaN.
    """
    target = rule_target(rule, lenience, probs)
    check_long("draft_tokens", draft_tokens, dims=1)
    check_rows("draft_tokens", draft_tokens, probs.rows)
    if rule == Rule.DRAFTER_ONLY:
        return torch.ones(draft_tokens.shape, dtype=torch.float32, device=draft_tokens.device)
    index = draft_tokens[:, None]
    draft_token_probs = probs.draft.gather(1, index).squeeze(1)  # [B]
    target_token_probs = target.gather(1, index).squeeze(1)  # [B]
    if rule == Rule.LENIENT:
        draft_token_probs = (1 - lenience) * draft_token_probs
    producible = draft_token_probs > 0
    ratio = target_token_probs / torch.where(producible, draft_token_probs, 1.0)
    return torch.where(producible, ratio.clamp(max=1), 0.0)


def residual_probs(rule: str, lenience: float, probs: Distributions) -> torch.Tensor:
    """Distribution of the replacement after a rejection: [B, V] float32, rows sum to 1.

    normalise(max(0, π − q)), with π = P for `lenient`. Where that has (near-)zero mass,
    π ≈ q and rejections (almost) never happen; π itself is returned there so that the
    result is always a distribution.
    """
    target = rule_target(rule, lenience, probs)
    excess = (target - probs.draft).clamp(min=0)  # [B, V]
    excess_mass = excess.double().sum(dim=-1, keepdim=True)  # [B, 1]
    has_residual = excess_mass > _MIN_RESIDUAL_MASS
    residual = excess / torch.where(has_residual, excess_mass, 1.0).float()
    return torch.where(has_residual, residual, target)


def greedy_verdict(
    rule: str, lenience: float, draft_tokens: torch.Tensor, probs: Distributions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (T = 0) verification: returns (accepted [B] bool, replacement [B] long).

    draft_tokens: [B] long. Only the decision distributions of `probs` are read, the
    temperature-1 unfiltered q and P (filters never change an argmax of P; they are
    ignored in greedy mode).
    - exact, verifier_only: accepted iff x = argmax P; replacement argmax P.
    - lenient: accepted iff P(x) ≥ (1 − λ)·max P; replacement argmax P.
    - cascades, drafter_only: accepted iff x = argmax π, π built from the temperature-1
      q and P; replacement argmax π.
    Ties go to the lowest token id (`greedy_tokens`); the non-speculative greedy path
    calls `greedy_tokens` on the same float32 P, so the two agree token for token.
    `replacement` is filled on every row; it is emitted where rejected.
    """
    decisions = Distributions(probs.decision_draft, probs.decision_target)
    target = rule_target(rule, lenience, decisions)
    check_long("draft_tokens", draft_tokens, dims=1)
    check_rows("draft_tokens", draft_tokens, target.shape[0])
    replacement = greedy_tokens(target)  # [B]
    if rule == Rule.LENIENT:
        draft_token_probs = target.gather(1, draft_tokens[:, None]).squeeze(1)
        accepted = draft_token_probs >= (1 - lenience) * target.amax(dim=-1)
    else:
        accepted = draft_tokens == replacement
    return accepted, replacement


def greedy_tokens(target_probs: torch.Tensor) -> torch.Tensor:
    """The greedy choice: target_probs [B, V] float32 → [B] long argmax, ties to the
    lowest token id. Greedy decoding takes it on probabilities, not log-probabilities:
    two log-probabilities a hair apart can round to the same float32 probability, and
    every greedy path must break that tie the same way."""
    check_float("target_probs", target_probs, dims=2)
    return first_argmax(target_probs)
