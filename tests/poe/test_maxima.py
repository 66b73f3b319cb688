import math

import pytest
import torch

from hydra_jury.poe.maxima import first_argmax, top_two_values

NAN, INF = math.nan, math.inf


def awkward_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with ties, NaNs (one and several), infinities and a 49,152-token row of logits
    rounded to a coarse grid, so that the maximum repeats."""
    small = torch.tensor(
        [
            [1.0, NAN, 3.0, NAN],
            [1.0, NAN, 3.0, 2.0],
            [2.0, 5.0, 5.0, 1.0],
            [-INF, -INF, -INF, -INF],
            [-INF, 0.0, -INF, -1.0],
            [7.0, 7.0, 7.0, 7.0],
            [1.0, 2.0, 3.0, INF],
        ]
    )
    wide = (torch.randn(3, 49_152, generator=torch.Generator().manual_seed(0)) * 4).round()
    return small, wide


def test_first_argmax_is_torch_argmax():
    small, wide = awkward_rows()
    for rows in (small, wide, wide.log_softmax(-1), wide[:, ::3], wide.double()):
        assert torch.equal(first_argmax(rows), rows.argmax(dim=-1))
    row = wide[0]
    assert torch.equal(first_argmax(row), row.argmax(dim=-1))  # one row: a 0-d tensor
    stacked = wide.reshape(3, 2, -1)  # [J, γ, V]: votes
    assert torch.equal(first_argmax(stacked), stacked.argmax(dim=-1))
    assert first_argmax(stacked).dtype == torch.long


def test_top_two_values_are_topk_values():
    small, wide = awkward_rows()
    for rows in (small, wide, wide.log_softmax(-1)):
        expected = rows.topk(2, dim=-1).values
        torch.testing.assert_close(top_two_values(rows), expected, rtol=0, atol=0, equal_nan=True)


def test_other_tensors_take_pytorch_own():
    logits = torch.randn(2, 64).bfloat16()
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    assert torch.equal(top_two_values(logits), logits.topk(2, dim=-1).values)
    trained = torch.randn(2, 64, requires_grad=True)
    assert torch.equal(first_argmax(trained), trained.argmax(-1))


def test_top_two_values_needs_two_columns():
    with pytest.raises(ValueError, match="V >= 2"):
        top_two_values(torch.zeros(2, 1))
    with pytest.raises(ValueError, match="V >= 2"):
        top_two_values(torch.zeros(3))
