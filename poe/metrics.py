"""Per-token and per-request metrics of PoE decoding.

Terms
- votes: each verifier's argmax token at a position, [B, H].
- entropy: H(P) = −Σ P log P of the target, in nats (0 · log 0 = 0).
- stability margin: the gap between the two largest target probabilities.
- stability radius of an emitted token: max(0, ⌊(n_A − n_B)/2⌋), n_A the votes for it,
  n_B the largest vote count of any other token (0 if none): how many verifiers can
  change their vote before the emitted token could lose the vote plurality.
- validity radius of a rejected draft token: the fewest votes that must move to it for
  it to hold strictly more votes than any other token.
- suppression score of a rejected draft token: P(token).
- logprob of a token: log P(token), floored at `LOGPROB_FLOOR` (log 0 is no number).
- round: one draft / verify / accept cycle of the decoding loop.
- reached: a draft position is reached in a round when every earlier draft token of
  that round was accepted, i.e. when an acceptance decision is taken on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from hydra_jury.poe._checks import check_float, check_long, check_rows, check_same_shape
from hydra_jury.poe.maxima import top_two_values
from hydra_jury.poe.row_kernels import row_kernels


def entropy(probs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """probs [B, V] P and logprobs [B, V] log P of the same rows (a round has both) →
    [B] float32 entropy in nats. A token of probability 0 adds 0 · log P = 0, or NaN
    where log P = −inf, which the NaN-skipping sum leaves out: 0 log 0 = 0. Not
    `special.entr(P)`: it takes a logarithm of every P in a scalar loop, 10× the time of
    this product and sum over a 49,152-token row. By the kernels where they take both."""
    check_float("probs", probs, dims=2)
    check_float("logprobs", logprobs, dims=2)
    check_same_shape("probs", probs, logprobs=logprobs)
    ops = row_kernels(probs, logprobs)
    if ops is not None:
        return ops.vocab_entropy(probs, logprobs)
    return -(probs.float() * logprobs.float()).nansum(dim=-1)


def stability_margin(logprobs: torch.Tensor) -> torch.Tensor:
    """logprobs: [B, V] log P → [B] float32, the largest probability minus the second
    largest (0 when V < 2). The two largest log P are those of the two largest P. By the
    kernels where they take the rows (their exp, within an ulp of PyTorch's)."""
    check_float("logprobs", logprobs, dims=2)
    ops = row_kernels(logprobs)
    if ops is not None:
        return ops.vocab_margin(logprobs)
    if logprobs.shape[1] < 2:
        return torch.zeros(logprobs.shape[0], dtype=torch.float32, device=logprobs.device)
    top_two = top_two_values(logprobs.float()).exp()  # [B, 2]
    return top_two[:, 0] - top_two[:, 1]


def stability_radius(votes: Sequence[int], token: int) -> int:
    """max(0, ⌊(n_A − n_B)/2⌋) for the emitted `token` and one position's `votes` (one
    per verifier). On a few small integers Python is quicker than tensor operations:
    each of those costs more to dispatch than this whole count (and list.count than a
    Counter, for a jury of up to a few dozen).

    Example: votes [7, 7, 7, 7, 7, 3, 3, 9], token 7 → n_A = 5, n_B = 2 → 1.
    """
    best_other_votes = max((votes.count(v) for v in set(votes) if v != token), default=0)
    return max(0, votes.count(token) - best_other_votes) // 2


def validity_radius(votes: Sequence[int], token: int) -> int:
    """Fewest votes that must move to `token` for it to have a strict plurality.

    Greedy: move one vote at a time from the current largest competitor. (Reasoning
    about the vote gap alone undercounts tied competitors: votes {A: 4, B: 4} need 4.)
    Examples: {A: 8} → 5; {A: 6, B: 2} → 4; token 2 votes with {A: 3, B: 3} → 2.
    """
    counts = Counter(votes)
    token_votes = counts.pop(token, 0)
    competitors = sorted(counts.values(), reverse=True)
    moved = 0
    while competitors and token_votes <= competitors[0]:
        competitors[0] -= 1
        competitors.sort(reverse=True)
        token_votes += 1
        moved += 1
    return moved


def suppression_score(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprobs: [B, V] log P, tokens: [B] long → [B] float32 P(token)."""
    return _of_tokens(logprobs, tokens).exp()


# log 0, as a number that JSON and every client can hold (OpenAI's API answers the same).
LOGPROB_FLOOR = -9999.0


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprobs: [B, V] log P, tokens: [B] long → [B] float32 log P(token), floored."""
    return _of_tokens(logprobs, tokens).clamp(min=LOGPROB_FLOOR)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs: [B, V] log P → the k most likely tokens of each row, most likely first
    ([B, k] long), and their log-probabilities ([B, k] float32, floored)."""
    check_float("logprobs", logprobs, dims=2)
    values, tokens = logprobs.float().topk(k, dim=-1)
    return tokens, values.clamp(min=LOGPROB_FLOOR)


def _of_tokens(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, V], [B] long → [B] float32 log P(tokens[b]) of each row."""
    check_float("logprobs", logprobs, dims=2)
    check_long("tokens", tokens, dims=1)
    check_rows("tokens", tokens, logprobs.shape[0])
    return logprobs.float().gather(1, tokens[:, None]).squeeze(1)


def reached_positions(num_drafted: int, num_accepted: int) -> int:
    """Draft positions a round took a decision on: the accepted ones, plus the rejected
    one when the round ended in a rejection. Examples: 4 drafted, 2 kept → 3; 4 of 4 → 4."""
    if not 0 <= num_accepted <= num_drafted:
        raise ValueError(
            f"need 0 <= num_accepted <= num_drafted, got {num_accepted} and {num_drafted}"
        )
    return num_accepted + 1 if num_accepted < num_drafted else num_accepted


@dataclass
class RequestStats:
    """Raw counters of one request; rates are derived, never stored.

    Counters
    - rounds: completed rounds; drafted / accepted: draft tokens proposed / kept.
    - emitted: tokens committed by the rounds. In the pending-token loop a round emits
      its accepted draft tokens plus the replacement when one was rejected; a round
      whose every draft token is accepted emits γ (its last token becomes the pending
      one, and there is no bonus token); a round with no draft (non-speculative step)
      emits the one token sampled from P.
    - reached_per_position[i] / accepted_per_position[i]: rounds that took a decision on
      / kept draft position i (0-based).
    - trunk_steps, head_evaluations: compute spent, incremented by the engine.

    Derived
    - acceptance_rate = accepted / drafted (0 with no draft).
    - mean_accepted_length = emitted / rounds: tokens committed per round, the
      replacement included (as vLLM's mean acceptance length includes its bonus token).
      Rounds accepting a of γ drafts count a + 1 when a < γ and γ when a = γ.
    - acceptance_per_position[i] = accepted_per_position[i] / reached_per_position[i]:
      the chance of keeping position i given that it was verified.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    trunk_steps: int = 0
    head_evaluations: int = 0

    def observe_round(self, num_drafted: int, num_accepted: int, bonus: bool = False) -> None:
        """Records one round: `num_drafted` tokens proposed, the first `num_accepted` kept,
        and with `bonus` one more token sampled from the target after all were kept (a
        one-pass verification round).

        num_drafted is γ, or fewer when the round was cut short by a stop condition (an
        accepted stop token, the token limit): then count the draft tokens up to it.
        """
        num_reached = reached_positions(num_drafted, num_accepted)
        self.rounds += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        rejected = num_accepted < num_drafted
        extra = rejected or num_drafted == 0 or bonus
        self.emitted += num_accepted + (1 if extra else 0)
        missing = num_reached - len(self.reached_per_position)
        if missing > 0:
            self.reached_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for position in range(num_reached):
            self.reached_per_position[position] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [
            accepted / reached if reached else 0.0
            for accepted, reached in zip(
                self.accepted_per_position, self.reached_per_position, strict=True
            )
        ]

    def counters(self) -> dict[str, object]:
        """The raw counters, a copy that shares no list with these."""
        values = {item.name: getattr(self, item.name) for item in fields(self)}
        values["reached_per_position"] = list(self.reached_per_position)
        values["accepted_per_position"] = list(self.accepted_per_position)
        return values

    def to_dict(self) -> dict[str, object]:
        """Counters and derived rates, JSON-ready."""
        return {
            **self.counters(),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
        }
