import math

import pytest
import torch

from hydra_jury.poe.metrics import (
    LOGPROB_FLOOR,
    RequestStats,
    entropy,
    stability_margin,
    stability_radius,
    suppression_score,
    token_logprobs,
    top_logprobs,
    validity_radius,
)
from hydra_jury.poe.target import probabilities


def test_entropy_in_nats_with_zero_probabilities():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25] * 4])
    expected = torch.tensor([math.log(2), 0.0, math.log(4)])
    torch.testing.assert_close(entropy(probs, probs.log()), expected)
    # The same as −Σ P log P from the probabilities alone, on a vocabulary-sized row
    # whose smallest probabilities `probabilities` reads as 0.
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * 12
    logprobs = logits.log_softmax(-1)
    reference = torch.special.entr(logprobs.double().exp()).sum(-1).float()
    torch.testing.assert_close(entropy(probabilities(logprobs), logprobs), reference)
    with pytest.raises(ValueError, match="shape"):
        entropy(probs, probs[:2].log())


def test_stability_margin():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.4, 0.4, 0.2]])
    torch.testing.assert_close(stability_margin(probs.log()), torch.tensor([0.3, 0.0]))
    assert stability_margin(torch.zeros(2, 1)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("votes", "radius"),
    [
        ([7, 7, 7, 7, 7, 3, 3, 9], 1),  # n_A 5, n_B 2
        ([7] * 8, 4),  # n_A 8, no other
        ([3, 3, 3, 7, 7, 9, 9, 9], 0),  # n_A 2, n_B 3
        ([1, 2, 3, 4, 5, 6, 8, 9], 0),  # n_A 0
        ([], 0),
    ],
)
def test_stability_radius(votes, radius):
    assert stability_radius(votes, 7) == radius


@pytest.mark.parametrize(
    ("votes", "token", "radius"),
    [
        ([1] * 8, 0, 5),  # all 8 for another token
        ([0, 0, 0, 1, 1, 2], 0, 0),  # already a strict plurality
        ([1, 1, 1, 1, 2, 2, 2, 2], 0, 4),  # {A: 4, B: 4}, none for the token
        ([1] * 6 + [2] * 2, 0, 4),  # {A: 6, B: 2}
        ([0, 0, 1, 1, 1, 2, 2, 2], 0, 2),  # token 2 votes, {A: 3, B: 3}
        ([0, 0, 1, 1], 0, 1),  # a tie is not a plurality
        ([], 0, 0),
    ],
)
def test_validity_radius(votes, token, radius):
    assert validity_radius(votes, token) == radius


def test_suppression_score():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    torch.testing.assert_close(
        suppression_score(probs.log(), torch.tensor([2, 0])), torch.tensor([0.3, 0.5])
    )


def test_logprobs_of_the_tokens_and_the_likeliest_floored_at_zero_probability():
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.5, 0.25, 0.25, 0.0]])
    torch.testing.assert_close(
        token_logprobs(probs.log(), torch.tensor([2, 3])),
        torch.tensor([math.log(0.3), LOGPROB_FLOOR]),
    )
    tokens, logprobs = top_logprobs(probs.log(), 2)
    assert tokens.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(logprobs, torch.tensor([[0.6, 0.3], [0.5, 0.25]]).log())
    tokens, logprobs = top_logprobs(probs.log(), 0)
    assert tokens.shape == logprobs.shape == (2, 0)


def test_request_stats_counts_and_rates():
    stats = RequestStats()
    stats.observe_round(num_drafted=4, num_accepted=4)  # all kept: emits 4
    stats.observe_round(num_drafted=4, num_accepted=1)  # 1 kept + replacement: emits 2
    stats.observe_round(num_drafted=4, num_accepted=0)  # replacement only: emits 1
    assert (stats.rounds, stats.drafted, stats.accepted, stats.emitted) == (3, 12, 5, 7)
    assert stats.reached_per_position == [3, 2, 1, 1]
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.acceptance_rate == pytest.approx(5 / 12)
    assert stats.mean_accepted_length == pytest.approx(7 / 3)
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0])
    exported = stats.to_dict()
    assert exported["accepted"] == 5 and exported["acceptance_rate"] == pytest.approx(5 / 12)
    assert exported["reached_per_position"] == [3, 2, 1, 1]


def test_request_stats_non_speculative_round_and_empty_stats():
    stats = RequestStats()
    assert (stats.acceptance_rate, stats.mean_accepted_length) == (0.0, 0.0)
    assert stats.acceptance_per_position == []
    stats.observe_round(num_drafted=0, num_accepted=0)
    assert (stats.emitted, stats.mean_accepted_length) == (1, 1.0)
    with pytest.raises(ValueError, match="num_accepted"):
        stats.observe_round(num_drafted=2, num_accepted=3)
