"""Prompt-lookup drafts and point-mass distributions."""

from __future__ import annotations

import random

import torch

from hydra_jury.poe import (
    Distributions,
    NgramIndex,
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


def test_a_lookup_tells_the_length_of_the_suffix_it_continues():
    index = NgramIndex()
    assert index.lookup([5, 6, 7, 9, 5, 6], 3) == ([7, 9, 5], 2)
    assert index.lookup([5, 6, 7, 9, 5, 6, 7], 1) == ([9], 3)
    assert index.lookup([1, 2, 3], 2) == ([], 0)
    assert index.lookup([4, 5, 4], 2, max_n=1) == ([5, 4], 1)


def test_no_match_no_draft():
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([7], 4) == []
    assert ngram_draft([1, 1], 0) == []
    assert ngram_draft([1, 1, 1], 3, max_n=1) == [1]  # the latest match: one token follows


def latest_lookup(tokens: list[int], gamma: int, max_n: int = 3) -> tuple[list[int], int]:
    """The definition, by brute force: the longest suffix first, its latest earlier
    occurrence (one with a token after it), continued; and that suffix's length."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + gamma], n
    return [], 0


def test_an_index_fed_a_growing_sequence_drafts_what_the_definition_does():
    rng = random.Random(0)
    for vocabulary in (2, 5, 40):
        index, tokens = NgramIndex(), []
        for _ in range(300):
            tokens.append(rng.randrange(vocabulary))
            gamma = rng.randint(0, 5)
            expected, match = latest_lookup(tokens, gamma) if gamma else ([], 0)
            assert index.lookup(tokens, gamma) == (expected, match if expected else 0)
            assert index.draft(tokens, gamma) == expected
            assert ngram_draft(tokens, gamma) == expected
            token = rng.randrange(vocabulary)
            assert index.occurs(tokens, token) is (token in tokens)


def test_an_index_given_another_sequence_starts_again():
    index = NgramIndex()
    assert index.draft([1, 2, 3, 1, 2], 2) == [3, 1]
    assert index.draft([7, 8, 7], 2) == [8, 7]  # shorter: not an extension
    assert index.draft([7, 9, 9, 7], 1) == [9]  # same length so far, another token
    assert not index.occurs([4, 5], 7)


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
