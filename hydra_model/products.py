"""Every product of activations with a weight, and every embedding lookup: one place that
chooses between the native kernels and PyTorch's own.

The kernels (`kernels/native.py`) take a few rows — a decode step, a speculative round,
a jury's positions of several sessions — at the memory bandwidth, and give each row the
same result whatever rows come with it. PyTorch's products take the rest: prefills (many
rows, compute-bound, where BLAS is at its best), training (gradients), other dtypes, and
machines without the kernels.
"""

from __future__ import annotations

import torch

from hydra_jury.hydra_model.kernels.native import native
from hydra_jury.hydra_model.quantization import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight
# Up to this many rows go to the kernels: every verify of a speculative round and a
# batch of sessions' rounds, where an output equal whatever its neighbours is what keeps
# a session's tokens the same alone and batched. Beyond, a product is a prefill.
KERNEL_MAX_ROWS = 64
# PyTorch's CPU BLAS multiplies 4 to 15 rows by a large matrix with small-row kernels
# that are slowest there (SmolLM2's 49,152 x 576 LM head: 8 rows 13.6 ms, 16 rows 9.7 ms
# on the 2-core development machine), and from 16 rows on each row comes out the same
# whatever its neighbours; without the kernels such products are padded to 16 rows.
PADDED_ROW_COUNTS = range(4, 16)


def product(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [S, R, inputs] (S may be an expanded dimension of one) times weight
    [S, outputs, inputs] transposed -> [S, R, outputs] in x's dtype."""
    ops = native() if _kernel_fits(x, weight) else None
    if ops is not None:
        if isinstance(weight, QuantizedWeight):
            if weight.minimum is None:
                return ops.rows_times_int8(x, weight.data, weight.scale)
            return ops.rows_times_int4(
                x, weight.data, weight.scale, weight.minimum, weight.group_size
            )
        return ops.rows_times_float32(x, weight)
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize(x.dtype)
    rows = x.shape[1]
    if rows in PADDED_ROW_COUNTS and x.shape[0] == 1:
        padding = x.new_zeros(1, PADDED_ROW_COUNTS.stop - rows, x.shape[2])
        return torch.bmm(torch.cat([x, padding], dim=1), weight.mT)[:, :rows]
    return torch.bmm(x, weight.mT)


def embed(weight: Weight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of an embedding [V, D] -> [len(tokens), D]."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(tokens, dtype)
    return weight[tokens]


def _kernel_fits(x: torch.Tensor, weight: Weight) -> bool:
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[1] <= KERNEL_MAX_ROWS
        and x.shape[2] % 32 == 0
        and x.stride(2) == 1
        and (x.shape[0] == weight.shape[0] or x.stride(0) == 0)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and (isinstance(weight, QuantizedWeight) or weight.is_contiguous())
    )
