"""Prompt-lookup drafts and point-mass distributions."""

from __future__ import annotations

import torch

from hydra_jury.poe import (
    Distributions,
    acceptance_probs,
    ngram_draft,
    point_mass_logprobs,
    residual_probs,
)


def test_the_latest_occurrence_of_the_longest_suffix_is_continued():
    assert ngram_draft([5, 6, 7, 9, 5, 6], 3) == [7, 9, 5]
    # Two occurrences of the suffix: the latest wins.
    assert ngram_draft([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]
    # The longest suffix first: [2, 3] occurs (followed by 8) though [3] occurs later.
    assert ngram_draft([2, 3, 8, 3, 9, 2, 3], 1) == [8]
    # Only as many tokens as follow the match.
    assert ngram_draft([4, 5, 4], 5) == [5, 4]


def test_no_match_no_draft():
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([7], 4) == []
    assert ngram_draft([1, 1], 0) == []
    assert ngram_draft([1, 1, 1], 3, max_n=1) == [1]  # the latest match: one token follows


def test_a_point_mass_draft_is_accepted_with_the_target_probability():
    target = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    tokens = torch.tensor([1, 2])
    draft = point_mass_logprobs(tokens, 3).exp()
    assert draft.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    keep = acceptance_probs("exact", 0.0, Distributions(draft, target), tokens)
    assert torch.allclose(keep, torch.tensor([0.3, 0.8]))
    residual = residual_probs("exact", 0.0, Distributions(draft, target))
    # P without the draft token, renormalised.
    assert torch.allclose(residual, torch.tensor([[5 / 7, 0.0, 2 / 7], [0.5, 0.5, 0.0]]))
