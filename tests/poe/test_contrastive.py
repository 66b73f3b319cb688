"""Contrastive scores: expert minus amateur on the expert's plausible set."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_jury.poe import contrastive_logprobs


def test_the_worked_example():
    expert = torch.tensor([[0.6, 0.3, 0.1]]).log()
    amateur = torch.tensor([[0.7, 0.1, 0.2]]).log()
    result = contrastive_logprobs(expert, amateur, 0.2).exp()
    torch.testing.assert_close(result, torch.tensor([[2 / 9, 7 / 9, 0.0]]))


def test_the_plausible_set_bounds_what_the_amateur_can_do(make_logits):
    expert = make_logits(5, 40, seed=1, scale=2.0).log_softmax(-1)
    amateur = make_logits(5, 40, seed=2, scale=2.0).log_softmax(-1)
    for alpha in (0.01, 0.1, 0.5, 1.0):
        result = contrastive_logprobs(expert, amateur, alpha)
        plausible = expert >= expert.amax(-1, keepdim=True) + math.log(alpha)
        assert torch.equal(result > -math.inf, plausible)
        scores = (expert - amateur).masked_fill(~plausible, -math.inf)
        assert torch.equal(result.argmax(-1), scores.argmax(-1))
    # α = 1 keeps the expert's argmax alone: plain greedy decoding.
    assert torch.equal(contrastive_logprobs(expert, amateur, 1.0).argmax(-1), expert.argmax(-1))


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan])
def test_alpha_outside_its_range_is_refused(alpha):
    probs = torch.full((1, 4), 0.25).log()
    with pytest.raises(ValueError, match=r"contrastive_alpha must be in \(0, 1\]"):
        contrastive_logprobs(probs, probs, alpha)
