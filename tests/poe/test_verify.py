"""Verification of a draft (`poe.verify`): what is kept, what replaces the first rejected
token, and the distribution of what is emitted."""

import pytest
import torch

from hydra_jury.poe import (
    Distributions,
    SamplingParams,
    Verification,
    categorical,
    filter_logprobs,
    leading_true,
    point_mass_logprobs,
    verify_coupled,
    verify_greedy,
    verify_sampled,
)
from hydra_jury.poe.verify import draw_token
from tests.statistics import chi_square_pvalue

VOCAB = 5
SEED = 7


def sharp(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows)


def test_leading_true():
    assert leading_true(torch.tensor([True, True, False, True])) == 2
    assert leading_true(torch.tensor([False, True])) == 0
    assert leading_true(torch.tensor([True, True])) == 2
    assert leading_true(torch.tensor([], dtype=torch.bool)) == 0


def test_greedy_keeps_the_argmax_prefix_and_replaces_with_the_argmax():
    target = sharp([0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6])
    draft = torch.full_like(target, 1 / 3)
    probs = Distributions(draft, target)
    assert verify_greedy("exact", 0.0, torch.tensor([1, 0, 2]), probs) == Verification(3, None)
    assert verify_greedy("exact", 0.0, torch.tensor([1, 2, 2]), probs) == Verification(1, 0)
    assert verify_greedy("exact", 0.0, torch.tensor([0, 0, 2]), probs) == Verification(0, 1)
    # lenient keeps a token with P(x) ≥ (1 − λ) · max P: at the first position, token 2
    # (P = 0.2) fails 0.4 · 0.7 = 0.28 but passes 0.25 · 0.7 = 0.175.
    assert verify_greedy("lenient", 0.6, torch.tensor([2, 1, 2]), probs) == Verification(0, 1)
    assert verify_greedy("lenient", 0.75, torch.tensor([2, 1, 2]), probs) == Verification(3, None)


def test_sampled_keeps_a_draft_the_target_agrees_with_and_replaces_an_impossible_one():
    target = sharp([0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0])
    probs = Distributions(target.clone(), target)  # q = P: every draft token is kept
    positions = torch.tensor([10, 11, 12])
    kept = verify_sampled("exact", 0.0, torch.tensor([1, 2, 0]), probs, SEED, positions)
    assert kept == Verification(3, None)
    # A draft token the target gives 0 at the second position: kept 1, and the
    # replacement comes from the residual max(0, P − q), never the rejected token.
    draft = sharp([0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
    verdict = verify_sampled(
        "exact", 0.0, torch.tensor([0, 0, 0]), Distributions(draft, target), SEED, positions
    )
    assert verdict.accepted == 1 and verdict.replacement in (1, 2)


def test_sampled_is_repeatable_and_keyed_by_position():
    generator = torch.Generator().manual_seed(3)
    draft = torch.rand(4, VOCAB, generator=generator).softmax(-1)
    target = torch.rand(4, VOCAB, generator=generator).softmax(-1)
    tokens = categorical(draft, SEED, torch.arange(4), "draft")
    probs = Distributions(draft, target)
    verdicts = {
        verify_sampled("exact", 0.0, tokens, probs, SEED, torch.arange(100, 104)) for _ in range(3)
    }
    assert len(verdicts) == 1


def test_coupled_emits_the_plain_step_draws_whatever_was_drafted():
    generator = torch.Generator().manual_seed(5)
    target = (3 * torch.randn(6, VOCAB, generator=generator)).softmax(-1)
    positions = torch.arange(20, 26)
    plain = categorical(target, SEED, positions, "sample")  # drawing from P, no draft
    for drafts in (plain, (plain + 1) % VOCAB, torch.cat([plain[:3], (plain[3:] + 2) % VOCAB])):
        probs = Distributions(point_mass_logprobs(drafts, VOCAB).exp(), target)
        verdict = verify_coupled("exact", 0.0, drafts, probs, SEED, positions)
        kept = verdict.accepted
        assert drafts[:kept].tolist() == plain[:kept].tolist()
        if kept < len(drafts):
            assert verdict.replacement == int(plain[kept]) != int(drafts[kept])
    assert verify_coupled("exact", 0.0, plain, probs, SEED, positions).accepted == 6


@pytest.mark.parametrize("verify", [verify_sampled, verify_coupled])
def test_the_first_emitted_token_follows_the_target(verify):
    """Over many seeds, the token at the first draft position (the draft when kept, else
    the replacement) is distributed as P, for a q far from P. 4,000 draws over 4
    categories (expected counts ≥ 400 each, no pooling needed); p < 1e-3 under an exact
    verifier is a 1-in-1000 event, and the seeds are fixed."""
    draft = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    probs = Distributions(draft, target)
    positions = torch.tensor([0])
    counts = torch.zeros(4, dtype=torch.long)
    for seed in range(4000):
        token = categorical(draft, seed, positions, "draft")
        verdict = verify("exact", 0.0, token, probs, seed, positions)
        emitted = int(token[0]) if verdict.accepted else verdict.replacement
        counts[emitted] += 1
    assert chi_square_pvalue(counts[None], target) > 1e-3


def test_draw_token_greedy_and_sampled():
    logprobs = torch.tensor([[0.1, 0.5, 0.3, 0.1]]).log()
    greedy = SamplingParams(temperature=0.0)
    assert draw_token(logprobs, greedy, SEED, 3, "sample") == (1, logprobs)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    token, chosen_from = draw_token(logprobs, sampling, SEED, 3, "sample")
    filtered = filter_logprobs(logprobs, sampling)
    assert torch.equal(chosen_from, filtered)
    assert token == int(categorical(filtered.exp(), SEED, torch.tensor([3]), "sample")[0])
    assert token in (1, 2)


def test_a_draw_reads_the_callers_probabilities_only_where_no_filter_moves_them():
    """The round hands the target's probabilities over (saving a pass over the vocabulary):
    with no filter on they are the row's, and the draws are those made without them; a
    filter makes its own, whatever the caller passed."""
    from hydra_jury.poe import probabilities

    generator = torch.Generator().manual_seed(2)
    logprobs = torch.randn(1, 64, generator=generator).log_softmax(-1)
    wrong = torch.zeros(1, 64)
    wrong[0, 0] = 1.0  # a point mass on token 0: read, every draw would be 0
    plain, filtered = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=8)
    for position in range(20):
        alone = draw_token(logprobs, plain, SEED, position, "sample")
        given = draw_token(logprobs, plain, SEED, position, "sample", probabilities(logprobs))
        assert given[0] == alone[0] and given[1] is alone[1]
        assert (
            draw_token(logprobs, filtered, SEED, position, "sample", wrong)[0]
            == (draw_token(logprobs, filtered, SEED, position, "sample")[0])
        )
    draws = {draw_token(logprobs, plain, SEED, p, "sample", wrong)[0] for p in range(20)}
    assert draws == {0}  # with no filter on, the caller's rows are the ones drawn from
