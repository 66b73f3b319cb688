import math

import pytest
import torch

from hydra_jury.poe.filters import SamplingParams, filter_logprobs

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def filtered_probs(probs: torch.Tensor, **options) -> torch.Tensor:
    return filter_logprobs(probs.log(), SamplingParams(**options)).exp()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    # Hand-computed values; float32 renormalisation is exact to ~1e-7.
    torch.testing.assert_close(actual, torch.tensor([expected]), atol=1e-6, rtol=0)


def test_all_off_is_identity():
    logprobs = PROBS.log()
    assert torch.equal(filter_logprobs(logprobs, SamplingParams()), logprobs)


def test_top_k_keeps_the_k_most_probable():
    assert_probs(filtered_probs(PROBS, top_k=2), [0.625, 0.375, 0.0, 0.0])
    assert torch.equal(filtered_probs(PROBS, top_k=4), PROBS.log().exp())


def test_top_k_ties_keep_exactly_k_lowest_ids():
    probs = torch.tensor([[0.2, 0.4, 0.2, 0.2]])
    assert_probs(filtered_probs(probs, top_k=2), [1 / 3, 2 / 3, 0.0, 0.0])


def test_top_p_keeps_smallest_set_reaching_the_mass():
    assert_probs(filtered_probs(PROBS, top_p=0.75), [0.625, 0.375, 0.0, 0.0])
    assert_probs(filtered_probs(PROBS, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_top_p_always_keeps_the_top_token():
    assert_probs(filtered_probs(PROBS, top_p=1e-9), [1.0, 0.0, 0.0, 0.0])


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert_probs(filtered_probs(PROBS, min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert_probs(filtered_probs(PROBS, min_p=0.59), [0.625, 0.375, 0.0, 0.0])


def test_top_p_is_measured_after_top_k():
    # After top-k=3 the masses are 0.526, 0.842: top-p 0.82 stops at two tokens. On the
    # unfiltered masses (0.5, 0.8) it would have kept three.
    assert_probs(filtered_probs(PROBS, top_k=3, top_p=0.82), [0.625, 0.375, 0.0, 0.0])


def test_epsilon_drops_tokens_below_an_absolute_floor():
    assert_probs(filtered_probs(PROBS, epsilon=0.1), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert_probs(filtered_probs(PROBS, epsilon=0.2), [0.625, 0.375, 0.0, 0.0])
    # Measured on what top-k left: 0.3 / 0.8 = 0.375 < 0.4.
    assert_probs(filtered_probs(PROBS, top_k=2, epsilon=0.4), [1.0, 0.0, 0.0, 0.0])
    # The most probable token is kept whatever the floor.
    assert_probs(filtered_probs(PROBS, epsilon=0.9), [1.0, 0.0, 0.0, 0.0])


def test_dropped_entries_are_minus_infinity_and_rows_normalised(make_logits):
    logprobs = make_logits(6, 30, seed=5, scale=2.0).log_softmax(-1)
    result = filter_logprobs(logprobs, SamplingParams(top_k=10, top_p=0.8, min_p=0.05))
    assert ((result == -math.inf) | torch.isfinite(result)).all()
    assert (result == -math.inf).any()
    torch.testing.assert_close(result.exp().sum(-1), torch.ones(6))


def test_rows_are_filtered_independently(make_logits):
    # The engine filters the draft and the target with the same call: filtering them
    # stacked gives the same as filtering each, whatever their shapes of distribution.
    draft = make_logits(3, 30, seed=6, scale=3.0).log_softmax(-1)
    target = make_logits(3, 30, seed=7, scale=0.5).log_softmax(-1)
    params = SamplingParams(temperature=0.7, top_k=12, top_p=0.85, min_p=0.01)
    stacked = filter_logprobs(torch.cat([draft, target]), params)
    assert torch.equal(stacked[:3], filter_logprobs(draft, params))
    assert torch.equal(stacked[3:], filter_logprobs(target, params))


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 5}, "top_k must be at most the vocabulary size 4"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon": 1.0}, r"epsilon must be in \[0, 1\)"),
    ],
)
def test_validate_names_the_bad_option(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options).validate(vocab_size=4)
    with pytest.raises(ValueError, match=message):
        filter_logprobs(PROBS.log(), SamplingParams(**options))


def test_validate_accepts_the_defaults_and_bounds():
    SamplingParams().validate(vocab_size=4)
    SamplingParams(temperature=0.0, top_k=4, top_p=1.0, min_p=0.0).validate(vocab_size=4)
    SamplingParams(top_k=10**6).validate()  # no vocabulary known yet
