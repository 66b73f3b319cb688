"""The shared LM head: each row of a product equals, bit for bit, the same row inside any
larger product (a jury shard's rows and the whole jury's), and stays the plain product to
float precision. With the native kernels this holds up to `KERNEL_MAX_ROWS` rows; without
them a product of 4 to 15 rows is padded to 16, from where PyTorch's BLAS gives each row
alike."""

from __future__ import annotations

import torch

from hydra_jury.hydra_model.heads import shared_lm_head
from hydra_jury.kernels.native import native


def test_a_few_rows_give_exactly_their_rows_of_a_larger_product():
    generator = torch.Generator().manual_seed(0)
    lm_head = torch.randn(49_152, 576, generator=generator) * 0.05  # SmolLM2's shape
    rows = torch.randn(32, 576, generator=generator)
    whole = shared_lm_head(rows, lm_head)  # [32, V]
    assert whole.shape == (32, 49_152)
    counts = (1, 3, 4, 8, 12, 15, 16, 24) if native() is not None else (4, 8, 12, 15, 16, 24)
    for count in counts:
        assert torch.equal(shared_lm_head(rows[:count], lm_head), whole[:count]), count
        assert torch.equal(shared_lm_head(rows[-count:], lm_head), whole[-count:]), count
    exact = rows.double() @ lm_head.double().T
    for count in (1, 3, 8):
        assert torch.allclose(
            shared_lm_head(rows[:count], lm_head).double(), exact[:count], atol=1e-4
        )
