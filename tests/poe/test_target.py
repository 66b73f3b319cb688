import numpy as np
import pytest
import torch
from scipy.special import log_softmax

from hydra_jury.poe.target import (
    combine_partials,
    draft_logprobs,
    normalise_logprobs,
    partial_log_product,
    probabilities,
    target_logprobs,
)
from hydra_jury.poe.target import log_softmax as poe_log_softmax


def reference_target_logprobs(verifier_logits: torch.Tensor, temperature: float, beta: float):
    """The PoE target written naively in float64."""
    logits = verifier_logits.double().numpy() / (temperature or 1.0)
    log_product = (beta * log_softmax(logits, axis=-1)).sum(axis=0)
    return log_softmax(log_product, axis=-1)


@pytest.mark.parametrize(("temperature", "beta"), [(1.0, 1.0), (0.7, 0.5), (1.5, 3.0), (0.0, 1.0)])
def test_matches_float64_reference(make_logits, temperature, beta):
    verifier_logits = make_logits(5, 6, 50, seed=1, scale=3.0)  # [H, N, V]
    result = target_logprobs(verifier_logits, temperature, beta)
    assert result.dtype == torch.float32 and result.shape == (6, 50)
    # Float32 log_softmax values are accurate to a few ulp of their magnitude (≲ 100 here,
    # ulp ≈ 8e-6); 1e-4 absolute leaves room for the sum over 5 heads.
    expected = reference_target_logprobs(verifier_logits, temperature, beta)
    np.testing.assert_allclose(result.numpy(), expected, atol=1e-4, rtol=1e-5)


def test_greedy_uses_temperature_one(make_logits):
    verifier_logits = make_logits(3, 4, 20, seed=2)
    assert torch.equal(
        target_logprobs(verifier_logits, 0.0, 1.0), target_logprobs(verifier_logits, 1.0, 1.0)
    )
    draft_logits = verifier_logits[0]
    assert torch.equal(draft_logprobs(draft_logits, 0.0), draft_logprobs(draft_logits, 1.0))


@pytest.mark.parametrize("num_heads", [1, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_stable_for_extreme_logits(num_heads, temperature):
    generator = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (num_heads, 4, 64), generator=generator) * 2 - 1
    verifier_logits = 1e4 * signs.float()  # [H, N, V], every logit ±1e4
    result = target_logprobs(verifier_logits, temperature, beta=10.0)
    assert torch.isfinite(result).all()
    # Sum of float32 probabilities: off from 1 by at most a few ulp per term.
    assert torch.allclose(result.exp().sum(-1), torch.ones(4), atol=1e-5)
    draft = draft_logprobs(verifier_logits[0], temperature)
    assert torch.isfinite(draft).all()
    assert torch.allclose(draft.exp().sum(-1), torch.ones(4), atol=1e-5)


def test_shard_partials_add_up_to_the_whole_jury(make_logits):
    verifier_logits = make_logits(8, 5, 40, seed=4, scale=2.0)
    shard_a = partial_log_product(verifier_logits[:3], 0.8, 1.5)
    shard_b = partial_log_product(verifier_logits[3:], 0.8, 1.5)
    combined = normalise_logprobs(combine_partials([shard_a, shard_b]))
    whole = target_logprobs(verifier_logits, 0.8, 1.5)
    # Only the order of float32 additions differs: a few ulp of values ≲ 100.
    torch.testing.assert_close(combined, whole, atol=1e-4, rtol=1e-5)


def test_shard_without_verifiers_contributes_nothing(make_logits):
    partial = partial_log_product(torch.empty(0, 3, 10), 1.0, 1.0)
    assert torch.equal(partial, torch.zeros(3, 10))


def test_bad_inputs_are_rejected(make_logits):
    logits = make_logits(2, 3, 10)
    with pytest.raises(ValueError, match="beta"):
        partial_log_product(logits, 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        partial_log_product(logits, -1.0, 1.0)
    with pytest.raises(ValueError, match="dimensions"):
        partial_log_product(logits[0], 1.0, 1.0)
    with pytest.raises(ValueError, match="at least one verifier"):
        target_logprobs(torch.empty(0, 3, 10), 1.0, 1.0)
    with pytest.raises(ValueError, match="shape"):
        combine_partials([torch.zeros(3, 10), torch.zeros(3, 11)])
    with pytest.raises(ValueError, match="at least one"):
        combine_partials([])


def test_identity_steps_are_skipped_without_changing_a_bit(make_logits):
    logits = make_logits(1, 3, 50)
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)
    assert torch.equal(partial_log_product(logits, 0.0, 1.0), shifted[0])
    assert torch.equal(partial_log_product(logits, 1.0, 1.0), shifted[0])
    # The target's normalisation subtracts the row's maximum first: the shift changes no
    # bit of it.
    assert torch.equal(normalise_logprobs(shifted[0]), normalise_logprobs(logits[0]))


def test_each_jurors_term_is_its_log_probabilities_up_to_a_constant(make_logits):
    logits = make_logits(3, 4, 50, seed=5, scale=4.0)
    partial = partial_log_product(logits, 0.7, 2.0)
    by_log_softmax = (2.0 * poe_log_softmax(logits / 0.7)).sum(0)
    offsets = (partial - by_log_softmax).double()  # one constant per row
    assert float((offsets - offsets[:, :1]).abs().max()) < 1e-4
    assert float(partial.max()) <= 0.0  # every term is at most 0
    torch.testing.assert_close(normalise_logprobs(partial), normalise_logprobs(by_log_softmax))


def test_probabilities_read_subnormal_ones_as_zero(make_logits):
    tiny = torch.finfo(torch.float32).tiny
    logprobs = torch.tensor([[0.0, -1.0, -87.0, -87.4, -100.0, -float("inf")]])
    probs = probabilities(logprobs)
    assert probs[0, 0] == 1.0 and probs[0, 2] >= tiny
    assert probs[:, 3:].tolist() == [[0.0, 0.0, 0.0]]
    # A 4-head product row: every probability within an ulp of exp's (in float64), or 0
    # where that is below the smallest normal number (no float32 lies between the
    # threshold and ln(tiny), so the two sets are the same).
    row = make_logits(4, 1, 49152).mul(8).log_softmax(-1).sum(0).log_softmax(-1)
    exact, read = row.double().exp(), probabilities(row)
    below = exact < tiny
    assert below.any() and not read[below].any()
    ulp = (torch.nextafter(read, torch.tensor(float("inf"))) - read).double()
    assert bool(((read.double() - exact).abs() <= ulp)[~below].all())
    assert torch.equal(read.argmax(-1), exact.argmax(-1))
