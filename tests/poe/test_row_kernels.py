"""The vocabulary-wide passes in the native kernels (kernels/vocabulary.h,
`poe.row_kernels`): the same bits on every instruction set, close to float64, PyTorch's
answers on special values, and the round's fused calls the bits of the separate ones."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import hydra_jury.poe.row_kernels as row_kernels_module
from hydra_jury.kernels.native import instruction_set, native
from hydra_jury.poe import (
    entropy,
    first_argmax,
    greedy_tokens,
    log_softmax,
    normalise_logprobs,
    partial_log_product,
    partial_log_product_and_votes,
    probabilities,
    stability_margin,
    target_rows,
)
from hydra_jury.poe.row_kernels import row_kernels

INF, NAN = math.inf, math.nan
TINY = torch.finfo(torch.float32).tiny


def rows(width: int, seed: int = 0) -> torch.Tensor:
    """Rows of log-products as a jury makes them, with what the passes must get right: a
    width that is not a whole number of 32-lane chunks, -inf entries, a repeated maximum
    (ties), and entries whose probability is below the smallest normal number."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(6, width, generator=generator) * torch.tensor([[1.0], [4], [8], [30], [1], [2]])
    x[1, width // 3] = -INF
    x[2, width // 4] = x[2, width - 1] = x[2].max() + 1.0  # the first of two maxima wins
    x[4] = 0.5  # every entry equal
    x[5, : width // 2] = -INF
    return x


def ulps(value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|value - exact| in units of value's last place."""
    spacing = (torch.nextafter(value, torch.tensor(INF)) - value).double()
    return (value.double() - exact).abs() / spacing


def every_set(kernels: list[str], compute) -> dict[str, object]:
    results = {}
    for isa in kernels:
        instruction_set(isa)
        results[isa] = compute()
    return results


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype and values, NaN where the other has NaN."""
    if a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


def assert_same_bits(results: dict[str, object]) -> None:
    (first, expected), *others = results.items()
    for isa, result in others:
        for a, b in zip(expected, result, strict=True):
            assert same_bits(a, b), (first, isa)


SPECIAL = torch.tensor(
    [
        [1.0, NAN, 2.0, NAN],  # a NaN: NaNs, and the first NaN is the argmax
        [-INF, -INF, -INF, -INF],  # no mass: NaNs
        [0.0, -INF, 3.0, 3.0],
    ]
)


@pytest.mark.parametrize("width", [1, 31, 32, 33, 1000, 49152])
def test_every_instruction_set_gives_the_same_bits(kernels, width):
    x = rows(width)
    ops = native()

    def compute():
        logprobs = ops.vocab_log_softmax(x)
        probs = ops.vocab_probabilities(logprobs)
        return (
            logprobs,
            probs,
            ops.vocab_entropy(probs, logprobs),
            ops.vocab_margin(logprobs),
            *ops.jury_rows(x[None]),
            *ops.target_rows(x),
        )

    assert_same_bits(every_set(kernels, compute))


def test_the_exp_is_within_an_ulp_and_reads_subnormal_results_as_zero(kernels):
    x = torch.cat([torch.linspace(-87.34, 88.72, 400_001), torch.linspace(-1.0, 0.0, 100_001)])
    exact = x.double().exp()
    for isa in kernels:
        instruction_set(isa)
        e = probabilities(x)
        normal = exact >= TINY  # no float32 lies between the threshold and ln(TINY)
        assert not e[~normal].any(), isa
        assert float(ulps(e[normal], exact[normal]).max()) <= 1.0, isa
    specials = torch.tensor([0.0, -0.0, -100.0, -INF, NAN, 88.8, INF])
    assert probabilities(specials).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, INF, INF]


def test_log_softmax_is_as_close_to_float64_as_pytorchs(kernels):
    x = rows(49152)[:4]
    x[1, 49152 // 3] = 0.0  # no -inf: compare every entry
    exact = torch.log_softmax(x.double(), -1)
    theirs = (torch.log_softmax(x, -1).double() - exact).abs().max()
    for isa in kernels:
        instruction_set(isa)
        ours = (log_softmax(x).double() - exact).abs().max()
        assert ours <= 1.5 * theirs + 1e-6, (isa, float(ours), float(theirs))


def test_special_rows_come_out_as_pytorchs(kernels):
    ops = native()
    for isa in kernels:
        instruction_set(isa)
        ours, theirs = log_softmax(SPECIAL), torch.log_softmax(SPECIAL, -1)
        assert torch.equal(ours.isnan(), theirs.isnan()), isa
        assert torch.equal(ours[2].isinf(), theirs[2].isinf())
        votes = ops.jury_rows(SPECIAL[:, None])[1][:, 0]  # three jurors, one position
        assert votes.tolist() == SPECIAL.argmax(-1).tolist() == [1, 0, 2]
        margins = stability_margin(SPECIAL)
        assert math.isnan(margins[0]) and margins[1] == 0.0 and margins[2] == 0.0


@pytest.mark.parametrize("x", [rows(1000), SPECIAL], ids=["rows", "special"])
def test_the_fused_calls_give_the_bits_of_the_separate_ones(kernels, x):
    for isa in kernels:
        instruction_set(isa)
        target = target_rows(x)
        logprobs = normalise_logprobs(x)
        probs = probabilities(logprobs)
        separate = (logprobs, probs, entropy(probs, logprobs), stability_margin(logprobs))
        fused = (target.logprobs, target.probs, target.entropy, target.margin)
        assert all(same_bits(a, b) for a, b in zip(fused, separate, strict=True)), isa
        assert torch.equal(target.greedy, greedy_tokens(probs))
        jury = x.reshape(x.shape[0] // 3 or 1, -1, x.shape[1])
        for temperature in (1.0, 0.8, 0.3, 1.7):  # the division by T is PyTorch's, too
            log_product, votes = partial_log_product_and_votes(jury, temperature, 1.0)
            assert same_bits(log_product, partial_log_product(jury, temperature, 1.0))
            scaled = jury if temperature == 1.0 else jury / temperature
            terms = scaled - scaled.amax(-1, keepdim=True)
            in_juror_order = functools.reduce(torch.add, terms)
            assert same_bits(log_product, in_juror_order), (isa, temperature)
            assert torch.equal(votes, first_argmax(jury))


def test_metrics_match_their_float64_definitions(kernels):
    x = rows(49152)
    target = target_rows(x)
    exact_logprobs = torch.log_softmax(x.double(), -1)
    exact_probs = exact_logprobs.exp()
    exact_entropy = -(exact_probs * exact_logprobs).nansum(-1)
    torch.testing.assert_close(target.entropy.double(), exact_entropy, rtol=1e-5, atol=1e-5)
    top_two = exact_probs.topk(2, -1).values
    torch.testing.assert_close(
        target.margin.double(), top_two[:, 0] - top_two[:, 1], rtol=1e-5, atol=1e-6
    )
    assert target.greedy.tolist() == exact_probs.argmax(-1).tolist()


def test_a_jurys_terms_add_up_in_juror_order_on_every_path(kernels, monkeypatch):
    """Four jurors over five positions, one of them with a NaN at one position: the
    kernels on every instruction set and PyTorch's operations give the same bits; the
    NaN makes only its position's total NaN; no jurors give zeros."""
    jury = torch.cat([rows(1000, seed=s) for s in range(4)])[:20]
    jury = jury.reshape(4, 5, 1000)
    jury[2, 3, 7] = NAN
    results = {}
    for isa in kernels:
        instruction_set(isa)
        results[isa] = partial_log_product_and_votes(jury, 0.8, 1.5)
    assert_same_bits(results)
    monkeypatch.setattr(row_kernels_module, "native", lambda: None)
    total, votes = partial_log_product_and_votes(jury, 0.8, 1.5)
    assert_same_bits({"kernels": results[kernels[0]], "pytorch": (total, votes)})
    assert total[3].isnan().all() and not total[[0, 1, 2, 4]].isnan().any()
    none = partial_log_product_and_votes(torch.empty(0, 5, 1000), 0.8, 1.5)
    assert torch.equal(none[0], torch.zeros(5, 1000)) and none[1].shape == (0, 5)


def test_without_the_kernels_every_pass_agrees(kernels, monkeypatch):
    """PyTorch's passes (no kernels, or tensors they do not take) give the same values to
    within float32 rounding, and the same greedy tokens and votes; the jurors' terms (a
    division and a subtraction) to the bit."""
    x = rows(1000)
    native_rows = target_rows(x)
    native_votes = partial_log_product_and_votes(x.reshape(2, 3, 1000), 1.0, 1.0)
    native_tempered = partial_log_product(x.reshape(2, 3, 1000), 0.8, 1.5)
    monkeypatch.setattr(row_kernels_module, "native", lambda: None)
    assert row_kernels(x) is None
    torch_rows = target_rows(x)
    for ours, theirs in zip(
        (native_rows.logprobs, native_rows.probs, native_rows.entropy, native_rows.margin),
        (torch_rows.logprobs, torch_rows.probs, torch_rows.entropy, torch_rows.margin),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(native_rows.greedy, torch_rows.greedy)
    torch_votes = partial_log_product_and_votes(x.reshape(2, 3, 1000), 1.0, 1.0)
    assert same_bits(native_votes[0], torch_votes[0])
    assert torch.equal(native_votes[1], torch_votes[1])
    assert same_bits(native_tempered, partial_log_product(x.reshape(2, 3, 1000), 0.8, 1.5))


def test_the_kernels_take_float32_cpu_rows_only(kernels):
    x = torch.randn(2, 8)
    assert row_kernels(x) is not None
    assert row_kernels(x.double()) is None
    assert row_kernels(torch.randn(2, 8, requires_grad=True)) is None
    assert row_kernels(torch.tensor(1.0)) is None and row_kernels(torch.zeros(2, 0)) is None
    # Float64 rows take PyTorch's passes, and keep their dtype.
    assert log_softmax(x.double()).dtype == torch.float64
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        native().vocab_log_softmax(x.double())
    with pytest.raises(RuntimeError, match="same shape"):
        native().vocab_entropy(x, x[:1])
