"""Maxima along a tensor's last axis: the first largest entry's index and the two largest
values, as `torch.argmax` and `torch.topk(2)` give them, bit for bit (a zero's sign aside: topk
may order 0 and −0 either way).

Why not those two: over a 49,152-token row they are scalar loops in PyTorch (43 and
83 µs on the 2-core development machine, 60 and 100 µs inside a decoding step, whose
weights have just flushed the caches). NumPy's argmax and max are vectorised (3 µs).
Both libraries give the first largest index, NaN counting as the largest, and so do the
kernels' fused passes of a round (`poe.row_kernels`), so a token never depends on which
one ran. Tensors NumPy cannot read without a copy (another device, bfloat16, gradients)
take PyTorch's own.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def _numpy_view(x: torch.Tensor) -> np.ndarray | None:
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.requires_grad:
        return None
    return x.numpy()


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] → [...] long: the index of each row's largest entry, the lowest on ties
    (`torch.argmax(x, dim=-1)`)."""
    view = _numpy_view(x)
    if view is None:
        return x.argmax(dim=-1)
    # (np.asarray: a 1-D row's argmax is a NumPy scalar, not an array)
    return torch.from_numpy(np.asarray(view.argmax(axis=-1), dtype=np.int64))


def top_two_values(x: torch.Tensor) -> torch.Tensor:
    """x [B, V ≥ 2] → [B, 2]: each row's largest value and the largest of the others
    (`torch.topk(x, 2, dim=-1).values`; equal to the first when the largest repeats)."""
    if x.dim() != 2 or x.shape[1] < 2:
        raise ValueError(f"top_two_values needs [B, V >= 2], got {list(x.shape)}")
    view = _numpy_view(x)
    if view is None:
        return x.topk(2, dim=-1).values
    out = np.empty((view.shape[0], 2), dtype=view.dtype)
    for row, (values, index) in enumerate(zip(view, view.argmax(axis=-1).tolist(), strict=True)):
        # Past the first largest entry (a NaN, if any) the second value is the largest of
        # the rest; np.maximum keeps a second NaN, as topk does.
        before = values[:index].max(initial=-np.inf)
        after = values[index + 1 :].max(initial=-np.inf)
        out[row, 0], out[row, 1] = values[index], np.maximum(before, after)
    return torch.from_numpy(out)
