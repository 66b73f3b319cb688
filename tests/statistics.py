"""Goodness-of-fit checks for the statistical tests: every one carries a control."""

from __future__ import annotations

import torch
from scipy.stats import chisquare


def chi_square_pvalue(counts: torch.Tensor, distribution: torch.Tensor) -> float:
    """Chi-square p-value of `counts` (any shape) under `distribution` (the same shape),
    pooling the cells whose expected count is below 5; 0 when a cell of probability 0
    was observed."""
    observed = counts.flatten().double()
    expected = distribution.flatten().double() * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    large = expected >= 5
    observed_bins, expected_bins = observed[large], expected[large]
    if expected[~large].sum() > 0:  # the pooled small cells, when there are any
        observed_bins = torch.cat([observed_bins, observed[~large].sum()[None]])
        expected_bins = torch.cat([expected_bins, expected[~large].sum()[None]])
    expected_bins *= observed_bins.sum() / expected_bins.sum()  # float rounding only
    return float(chisquare(observed_bins.numpy(), expected_bins.numpy()).pvalue)


def assert_fits(counts: torch.Tensor, distribution: torch.Tensor, wrong: torch.Tensor) -> None:
    """The counts fit `distribution` (p > 1e-4) and, as a control that the test can fail, do not
    fit the plausible mistake `wrong` (p < 1e-10)."""
    pvalue = chi_square_pvalue(counts, distribution)
    assert pvalue > 1e-4, f"chi-square p = {pvalue:.2e}"
    control = chi_square_pvalue(counts, wrong)
    assert control < 1e-10, f"the control fits too (p = {control:.2e}): the test is too weak"
