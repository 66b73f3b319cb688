import math

import numpy as np
import pytest
import torch

from hydra_jury.poe.filters import SamplingParams, filter_logprobs
from hydra_jury.poe.randomness import categorical, uniforms
from hydra_jury.poe.rules import (
    RULES,
    Distributions,
    acceptance_probs,
    greedy_verdict,
    residual_probs,
    rule_target,
    validate_rule,
)
from hydra_jury.poe.target import draft_logprobs, target_logprobs
from tests.statistics import chi_square_pvalue

LENIENCE = {
    "exact": 0.0,
    "lenient": 0.3,
    "cascade_chow": 0.5,
    "cascade_diff": 0.15,
    "cascade_opt": 0.5,
    "cascade_token_v1": 0.3,
    "cascade_token_v2": 0.3,
    "cascade_token_v3": 0.5,
    "drafter_only": 0.0,
}
NUM_PAIRS, VOCAB, DRAWS = 4, 8, 100_000
SAMPLING_TEMPERATURE = 1.25  # ≠ 1, so π (tempered) and the decisions (T = 1) differ
FILTERS = {
    "unfiltered": SamplingParams(temperature=SAMPLING_TEMPERATURE),
    # Each filter drops tokens the ones before it kept (epsilon 0.08: a token of two of
    # the targets), so every filter's part in exactness is tested.
    "filtered": SamplingParams(
        temperature=SAMPLING_TEMPERATURE, top_k=6, top_p=0.9, min_p=0.05, epsilon=0.08
    ),
}


# --- an independent float64 reference for the output distribution of each rule ---


def normalise(weights: np.ndarray) -> np.ndarray:
    return weights / weights.sum(axis=-1, keepdims=True)


def reference_target(rule, lenience, draft, target, decision_draft, decision_target):
    """π per pair, [K, V] float64, written from the rule definitions."""
    max_draft = decision_draft.max(axis=-1, keepdims=True)
    max_target = decision_target.max(axis=-1, keepdims=True)
    if rule in ("exact", "lenient"):
        return target
    if rule == "drafter_only":
        return draft
    if rule in ("cascade_chow", "cascade_diff", "cascade_opt"):
        if rule == "cascade_chow":
            use_draft = max_draft >= 1 - lenience
        elif rule == "cascade_diff":
            use_draft = max_draft >= max_target - lenience
        else:
            distance = np.maximum(decision_draft - decision_target, 0).sum(-1, keepdims=True)
            use_draft = max_draft >= max_target - lenience * distance
        return np.where(use_draft, draft, target)
    in_set = {
        "cascade_token_v1": decision_draft >= max_target - lenience,
        "cascade_token_v2": decision_target >= max_target - lenience,
        "cascade_token_v3": decision_target >= (1 - lenience) * max_target,
    }[rule]
    kept_draft = np.where(in_set, draft, 0.0)
    # The mass left for the jury is >= 0; clipped, so that rounding never makes it negative.
    return kept_draft + np.clip(1 - kept_draft.sum(-1, keepdims=True), 0, None) * target


def reference_output(rule, lenience, draft, target, decision_draft, decision_target):
    """Distribution of the emitted token per pair, [K, V] float64."""
    if rule != "lenient":
        return reference_target(rule, lenience, draft, target, decision_draft, decision_target)
    accepted_mass = np.minimum(draft, target / (1 - lenience))  # q(x)·min(1, P/((1−λ)q))
    residual = normalise(np.maximum(target - draft, 0))
    return accepted_mass + np.clip(1 - accepted_mass.sum(-1, keepdims=True), 0, None) * residual


@pytest.fixture
def pairs(make_logits):
    """Four draft/target pairs of different sharpness, so that every pair-level cascade
    picks the drafter for some pairs and the jury for others."""
    draft_logits = make_logits(NUM_PAIRS, VOCAB, seed=1234, scale=[2.5, 0.7, 2.0, 1.2])
    target_logits = make_logits(NUM_PAIRS, VOCAB, seed=4321, scale=[0.8, 2.0, 1.8, 1.2])
    return draft_logits, target_logits


def sample_with_rule(rule, lenience, draft_probs, target_probs, decision_draft, decision_target):
    """One speculative step per row: x ~ q, keep with acceptance_probs, else residual."""
    rows = draft_probs.shape[0]
    positions = torch.arange(rows) + 10_000  # distinct keys: independent draws per row
    draft_tokens = categorical(draft_probs, 0, positions, "draft")
    probs = Distributions(draft_probs, target_probs, decision_draft, decision_target)
    keep_probs = acceptance_probs(rule, lenience, probs, draft_tokens)
    accepted = uniforms(0, positions, "accept") < keep_probs.double()
    residual = residual_probs(rule, lenience, probs)
    replacement = categorical(residual, 0, positions, "residual")
    return torch.where(accepted, draft_tokens, replacement)


@pytest.mark.parametrize("filter_name", sorted(FILTERS))
@pytest.mark.parametrize("rule", sorted(LENIENCE))
def test_sampling_follows_the_rule_distribution(pairs, rule, filter_name):
    draft_logits, target_logits = pairs
    params, lenience = FILTERS[filter_name], LENIENCE[rule]
    draft_probs = filter_logprobs(draft_logprobs(draft_logits, params.temperature), params).exp()
    jury = target_logprobs(target_logits[None], params.temperature, beta=1.0)  # one verifier
    target_probs = filter_logprobs(jury, params).exp()
    decision_draft, decision_target = draft_logits.softmax(-1), target_logits.softmax(-1)
    if filter_name == "filtered":
        assert (draft_probs == 0).any() and (target_probs == 0).any()

    pair_of_row = torch.arange(DRAWS) % NUM_PAIRS
    per_row = [probs[pair_of_row] for probs in (draft_probs, target_probs)]  # [DRAWS, V] each
    decisions_per_row = [probs[pair_of_row] for probs in (decision_draft, decision_target)]
    emitted = sample_with_rule(rule, lenience, *per_row, *decisions_per_row)
    observed = torch.bincount(pair_of_row * VOCAB + emitted, minlength=NUM_PAIRS * VOCAB)
    observed = observed.reshape(NUM_PAIRS, VOCAB)

    # The float32 inputs, normalised in float64: the reference's sums are then 1 to within
    # float64 rounding, whatever float path computed the probabilities.
    as64 = [
        normalise(t.double().numpy())
        for t in (draft_probs, target_probs, decision_draft, decision_target)
    ]
    if rule in ("cascade_chow", "cascade_diff", "cascade_opt"):
        picks_draft = np.all(reference_target(rule, lenience, *as64) == as64[0], axis=-1)
        assert picks_draft.any() and not picks_draft.all(), "pairs must exercise both branches"
    expected = torch.from_numpy(reference_output(rule, lenience, *as64))

    # Four independent multinomials of DRAWS / 4 draws each, one per pair (pair_of_row). A
    # token's probability may be 0 only up to rounding (pair 0's residual mass under
    # cascade_token_v1/v2 is exactly 0 but 1e-9 in float32): chi_square_pvalue pools such
    # cells, so its >= 5 expected counts per cell hold by construction on every CPU.
    # Under an exact sampler the p-value is uniform, so p < 1e-3 is a 1-in-1000 event;
    # with fixed seeds the outcome is deterministic. Power: moving 0.02 of probability
    # between two tokens of probability ≈ 0.2 in one pair (25,000 draws) adds about
    # 2 · 25,000 · 0.02² / 0.2 = 100 to the statistic, whose 1e-3 critical value is ≈ 57
    # for 28 degrees of freedom (and see the control test below). A token of probability
    # exactly 0 that is emitted gives p = 0.
    pvalue = chi_square_pvalue(observed, expected, rows=True)
    assert pvalue > 1e-3, f"{rule}/{filter_name}: p = {pvalue:.2e}"


def test_chi_square_detects_a_wrong_residual(pairs):
    """Control: the same test rejects a sampler that redraws from P instead of the residual."""
    draft_logits, target_logits = pairs
    draft_probs, target_probs = draft_logits.softmax(-1), target_logits.softmax(-1)
    pair_of_row = torch.arange(DRAWS) % NUM_PAIRS
    positions = torch.arange(DRAWS)
    draft_rows, target_rows = draft_probs[pair_of_row], target_probs[pair_of_row]
    draft_tokens = categorical(draft_rows, 0, positions, "draft")
    keep_probs = acceptance_probs(
        "exact", 0.0, Distributions(draft_rows, target_rows), draft_tokens
    )
    accepted = uniforms(0, positions, "accept") < keep_probs.double()
    wrong = categorical(target_rows, 0, positions, "residual")
    emitted = torch.where(accepted, draft_tokens, wrong)
    observed = torch.bincount(pair_of_row * VOCAB + emitted, minlength=NUM_PAIRS * VOCAB)
    observed = observed.reshape(NUM_PAIRS, VOCAB)
    assert chi_square_pvalue(observed, target_probs, rows=True) < 1e-3


# --- deferral decisions on hand-made cases (V = 3) ---

Q_DEC = torch.tensor([[0.6, 0.3, 0.1]])
P_DEC = torch.tensor([[0.1, 0.2, 0.7]])


def target_of(rule, lenience, draft=Q_DEC, target=P_DEC, decision_draft=Q_DEC):
    return rule_target(rule, lenience, Distributions(draft, target, decision_draft, P_DEC))


@pytest.mark.parametrize(
    ("rule", "lenience", "picks_draft"),
    [
        ("cascade_chow", 0.4, True),  # 0.6 ≥ 1 − 0.4
        ("cascade_chow", 0.3, False),  # 0.6 < 0.7
        ("cascade_diff", 0.1, True),  # 0.6 ≥ 0.7 − 0.1
        ("cascade_diff", 0.05, False),  # 0.6 < 0.65
        ("cascade_opt", 0.2, True),  # TV = 0.6: 0.6 ≥ 0.7 − 0.2·0.6
        ("cascade_opt", 0.1, False),  # 0.6 < 0.7 − 0.1·0.6
    ],
)
def test_pair_level_cascades_choose_draft_or_jury(rule, lenience, picks_draft):
    expected = Q_DEC if picks_draft else P_DEC
    torch.testing.assert_close(target_of(rule, lenience), expected)


def test_cascades_decide_on_the_decision_distributions():
    # The tempered draft is sharp, but the temperature-1 draft is not confident enough.
    sharp_draft = torch.tensor([[0.95, 0.04, 0.01]])
    picked = target_of("cascade_chow", 0.3, draft=sharp_draft)
    torch.testing.assert_close(picked, P_DEC)
    # Confident at temperature 1: π is the tempered draft itself.
    confident = torch.tensor([[0.8, 0.1, 0.1]])
    picked = target_of("cascade_chow", 0.3, draft=sharp_draft, decision_draft=confident)
    torch.testing.assert_close(picked, sharp_draft)


@pytest.mark.parametrize(
    ("rule", "lenience", "expected"),
    [
        # A = {q ≥ 0.7 − 0.2} = {0}: π = [0.6, 0, 0] + 0.4·P
        ("cascade_token_v1", 0.2, [0.64, 0.08, 0.28]),
        # A = {P ≥ 0.5} = {2}: π = [0, 0, 0.1] + 0.9·P
        ("cascade_token_v2", 0.2, [0.09, 0.18, 0.73]),
        # A = {P ≥ 0.25·0.7} = {1, 2}: π = [0, 0.3, 0.1] + 0.6·P
        ("cascade_token_v3", 0.75, [0.06, 0.42, 0.52]),
        ("exact", 0.0, [0.1, 0.2, 0.7]),
        ("lenient", 0.5, [0.1, 0.2, 0.7]),
        ("verifier_only", 0.0, [0.1, 0.2, 0.7]),
        ("drafter_only", 0.0, [0.6, 0.3, 0.1]),
    ],
)
def test_rule_targets(rule, lenience, expected):
    torch.testing.assert_close(target_of(rule, lenience), torch.tensor([expected]))


# --- acceptance and residual details ---


def test_acceptance_probs_on_hand_made_cases():
    tokens = torch.tensor([0])
    hand_made = Distributions(Q_DEC, P_DEC)
    exact = acceptance_probs("exact", 0.0, hand_made, tokens)
    torch.testing.assert_close(exact, torch.tensor([0.1 / 0.6]))
    lenient = acceptance_probs("lenient", 0.5, hand_made, tokens)
    torch.testing.assert_close(lenient, torch.tensor([0.1 / 0.3]))
    cheap = acceptance_probs("drafter_only", 0.0, hand_made, tokens)
    torch.testing.assert_close(cheap, torch.tensor([1.0]))


def test_draft_token_of_zero_draft_probability_is_rejected_without_nan():
    draft = torch.tensor([[1.0, 0.0, 0.0]])
    for rule in RULES:
        if rule == "drafter_only":
            continue
        keep = acceptance_probs(rule, 0.5, Distributions(draft, P_DEC), torch.tensor([2]))
        assert keep.item() == 0.0, rule


def test_residual_falls_back_to_the_target_when_draft_equals_target():
    residual = residual_probs("exact", 0.0, Distributions(P_DEC, P_DEC))
    torch.testing.assert_close(residual, P_DEC)
    residual = residual_probs("drafter_only", 0.0, Distributions(Q_DEC, P_DEC))
    torch.testing.assert_close(residual, Q_DEC)


def test_residual_is_the_normalised_excess():
    residual = residual_probs("exact", 0.0, Distributions(Q_DEC, P_DEC))
    torch.testing.assert_close(residual, torch.tensor([[0.0, 0.0, 1.0]]))
    both_ways = torch.tensor([[0.2, 0.5, 0.3]])
    residual = residual_probs("lenient", 0.2, Distributions(both_ways, P_DEC))
    torch.testing.assert_close(residual, torch.tensor([[0.0, 0.0, 1.0]]))


def test_verifier_only_behaves_as_exact(make_logits):
    draft, target = make_logits(2, 5, 10, seed=9).softmax(-1)
    tokens = torch.tensor([1, 4, 7, 0, 9])
    probs = Distributions(draft, target)
    for function, extra in ((acceptance_probs, (tokens,)), (residual_probs, ())):
        exact = function("exact", 0.0, probs, *extra)
        assert torch.equal(function("verifier_only", 0.0, probs, *extra), exact)


def test_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        Distributions(Q_DEC, torch.ones(1, 4) / 4)
    with pytest.raises(ValueError, match="shape"):
        Distributions(Q_DEC, P_DEC, decision_target=torch.ones(2, 3) / 3)
    with pytest.raises(ValueError, match="floating-point"):
        Distributions(Q_DEC, torch.tensor([[1, 0, 0]]))
    with pytest.raises(ValueError, match="rows"):
        acceptance_probs("exact", 0.0, Distributions(Q_DEC, P_DEC), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="int64"):
        acceptance_probs("exact", 0.0, Distributions(Q_DEC, P_DEC), torch.tensor([0.0]))


# --- greedy ---


def verdict(rule, lenience, tokens, decision_draft=Q_DEC, decision_target=P_DEC):
    """greedy_verdict for several draft tokens against the same one-row distributions."""
    rows = len(tokens)
    decisions = Distributions(decision_draft.expand(rows, -1), decision_target.expand(rows, -1))
    accepted, replacement = greedy_verdict(rule, lenience, torch.tensor(tokens), decisions)
    return accepted.tolist(), replacement.tolist()


def test_greedy_exact_accepts_only_the_jury_argmax():
    assert verdict("exact", 0.0, [2]) == ([True], [2])
    assert verdict("exact", 0.0, [0]) == ([False], [2])
    assert verdict("verifier_only", 0.0, [0]) == ([False], [2])


def test_greedy_ties_go_to_the_lowest_token_id():
    tied = torch.tensor([[0.4, 0.4, 0.2]])
    assert verdict("exact", 0.0, [1], decision_target=tied) == ([False], [0])


def test_greedy_lenient_accepts_near_argmax_tokens():
    jury = torch.tensor([[0.5, 0.3, 0.2]])
    assert verdict("lenient", 0.5, [1, 2], decision_target=jury) == ([True, False], [0, 0])


def test_greedy_cascades_follow_the_argmax_of_pi():
    # chow λ=0.4 defers to the draft (0.6 ≥ 0.6): its argmax 0 is accepted.
    assert verdict("cascade_chow", 0.4, [0, 2]) == ([True, False], [0, 0])
    # λ=0.3 keeps the jury: token 0 is replaced by the jury's argmax.
    assert verdict("cascade_chow", 0.3, [0]) == ([False], [2])
    # token_v1 λ=0.2: π = [0.64, 0.08, 0.28].
    assert verdict("cascade_token_v1", 0.2, [0, 2]) == ([True, False], [0, 0])
    assert verdict("drafter_only", 0.0, [0]) == ([True], [0])


# --- validation ---


@pytest.mark.parametrize(
    ("rule", "lenience", "message"),
    [
        ("speed", 0.0, "unknown acceptance rule 'speed'; choose one of exact, lenient"),
        ("exact", 1.5, "0 <= lenience <= 1"),
        ("exact", math.nan, "finite"),
        ("drafter_only", -0.1, "0 <= lenience <= 1"),
        ("lenient", 1.0, "0 <= lenience < 1"),
        ("cascade_chow", 1.01, "0 <= lenience <= 1"),
        ("cascade_opt", 2.0, "0 <= lenience <= 1"),
        ("cascade_token_v3", -0.5, "0 <= lenience <= 1"),
        ("cascade_diff", math.inf, "finite"),
    ],
)
def test_validate_rule_errors(rule, lenience, message):
    with pytest.raises(ValueError, match=message):
        validate_rule(rule, lenience)


@pytest.mark.parametrize("rule", RULES)
def test_validate_rule_accepts_the_range_ends(rule):
    validate_rule(rule, 0.0)
    validate_rule(rule, 0.99)
    if rule != "lenient":
        validate_rule(rule, 1)


def test_opt_at_lenience_one_always_defers_to_the_draft(make_logits):
    # Why cascade_opt stops at λ = 1: max P − TV ≤ q(argmax P) ≤ max q for every pair.
    decision_draft = make_logits(1000, 16, seed=11, scale=3.0).softmax(-1)
    decision_target = make_logits(1000, 16, seed=12, scale=3.0).softmax(-1)
    draft = torch.full_like(decision_draft, 1 / 16)  # a marker to see which side π took
    target = torch.zeros_like(decision_target)
    probs = Distributions(draft, target, decision_draft, decision_target)
    picked = rule_target("cascade_opt", 1.0, probs)
    assert torch.equal(picked, draft)
