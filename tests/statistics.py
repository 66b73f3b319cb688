"""Goodness-of-fit checks for the statistical tests: every one carries a control.

The chi-square approximation needs at least 5 expected counts in every cell. That holds here
by construction, whatever the float path: cells below it are pooled, and a pool still below
it joins its multinomial's smallest cell above it. A cell whose probability is 0 only up to
rounding (a residual mass of 1e-9 left by float32 probabilities that do not sum to exactly
1, say) therefore never decides whether a test can run; a cell of probability exactly 0
must never be observed.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

MIN_EXPECTED = 5.0


def pooled_cells(
    observed: torch.Tensor, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One multinomial's observed and expected counts (1-D, float64), with every expected
    count >= MIN_EXPECTED."""
    large = expected >= MIN_EXPECTED
    if int(large.sum()) < 2:
        raise ValueError(
            f"fewer than two cells expect >= {MIN_EXPECTED:g} counts: the test needs more draws"
        )
    pooled_observed, pooled_expected = observed[~large].sum(), expected[~large].sum()
    observed, expected = observed[large].clone(), expected[large].clone()
    if pooled_expected >= MIN_EXPECTED:
        return torch.cat([observed, pooled_observed[None]]), torch.cat(
            [expected, pooled_expected[None]]
        )
    smallest = expected.argmin()
    observed[smallest] += pooled_observed
    expected[smallest] += pooled_expected
    return observed, expected


def chi_square_pvalue(
    counts: torch.Tensor, distribution: torch.Tensor, *, rows: bool = False
) -> float:
    """Chi-square p-value of `counts` under `distribution` (the same shape); 0 when a cell of
    probability 0 was observed.

    rows=False: all cells form one multinomial. rows=True: each row of 2-D `counts` is its
    own multinomial whose total the experiment fixed (its expected counts are its row of
    `distribution`, normalised, times that total), hence one degree of freedom fewer per
    row beyond the first."""
    observed = counts.double().reshape(counts.shape[0] if rows else 1, -1)
    weights = distribution.double().reshape(observed.shape)
    if (weights < 0).any():
        raise ValueError("a distribution has a negative probability")
    if observed[weights == 0].sum() > 0:
        return 0.0
    expected = weights / weights.sum(-1, keepdim=True) * observed.sum(-1, keepdim=True)
    bins = [pooled_cells(o, e) for o, e in zip(observed, expected, strict=True)]
    observed_bins = torch.cat([o for o, _ in bins])
    expected_bins = torch.cat([e for _, e in bins])
    result = chisquare(observed_bins.numpy(), expected_bins.numpy(), ddof=len(bins) - 1)
    return float(result.pvalue)


def assert_fits(counts: torch.Tensor, distribution: torch.Tensor, wrong: torch.Tensor) -> None:
    """The counts fit `distribution` (p > 1e-4) and, as a control that the test can fail, do not
    fit the plausible mistake `wrong` (p < 1e-10)."""
    pvalue = chi_square_pvalue(counts, distribution)
    assert pvalue > 1e-4, f"chi-square p = {pvalue:.2e}"
    control = chi_square_pvalue(counts, wrong)
    assert control < 1e-10, f"the control fits too (p = {control:.2e}): the test is too weak"
