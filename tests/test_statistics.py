"""The chi-square helper's precondition holds by construction (tests/statistics.py)."""

from __future__ import annotations

import pytest
import torch

from tests.statistics import MIN_EXPECTED, chi_square_pvalue, pooled_cells


@pytest.mark.parametrize(
    "expected",
    [
        [40.0, 30.0, 29.9, 0.1],  # a pool of 0.1 joins the smallest large cell
        [50.0, 40.0, 3.0, 3.0, 4.0],  # a pool of 10 stays a cell of its own
        [50.0, 50.0, 1e-9, -0.0],  # probability 0 up to rounding
        [60.0, 40.0],  # nothing to pool
    ],
)
def test_every_pooled_cell_expects_at_least_five(expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    observed = torch.arange(len(expected), dtype=torch.float64)
    pooled_observed, pooled_expected = pooled_cells(observed, expected)
    assert (pooled_expected >= MIN_EXPECTED).all()
    assert pooled_expected.sum() == pytest.approx(expected.sum())
    assert pooled_observed.sum() == observed.sum()


def test_too_few_draws_are_a_design_error():
    with pytest.raises(ValueError, match="needs more draws"):
        pooled_cells(torch.tensor([3.0, 2.0]), torch.tensor([4.0, 1.0], dtype=torch.float64))


def test_rows_are_separate_multinomials():
    # Each row matches its own distribution exactly (p = 1), not the first row's (a cell of
    # probability 0 is observed: p = 0).
    counts = torch.tensor([[500, 500, 0], [0, 100, 900]])
    distribution = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.1, 0.9]])
    assert chi_square_pvalue(counts, distribution, rows=True) == pytest.approx(1.0)
    assert (
        chi_square_pvalue(counts, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]), rows=True)
        == 0.0
    )


def test_an_impossible_cell_observed_gives_zero():
    counts = torch.tensor([10, 10, 1])
    assert chi_square_pvalue(counts, torch.tensor([0.5, 0.5, 0.0])) == 0.0
