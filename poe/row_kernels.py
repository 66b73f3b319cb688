"""The package's passes over vocabulary-wide rows — log-softmax, the thresholded exp of
`probabilities`, the entropy, the stability margin — in the native kernels
(kernels/vocabulary.h) where they take the tensors, in PyTorch's operations
where they do not.

Why: a plain decoding step makes about eight passes over a 49,152-token row, and each
PyTorch operation among them took 2 to 4 times its own time inside a step (the step's
weights have just flushed the caches that the interpreter and the dispatcher run from).
The kernels make each pass one call, and the round's passes two (`target_rows`, the
jury's `jury_rows`).

Bits: the kernels' exp and sums are their own, the same on every instruction set (so a
token never depends on the CPU); PyTorch's differ from them by about an ulp (the jury's
terms, a division and a subtraction added in juror order, not at all). They take
float32 CPU tensors without gradients once the kernels load (`HYDRA_JURY_KERNELS`); the
rest (another device, float64, training) take PyTorch's. Every path of a request reads
float32 CPU rows, so it reads one implementation throughout.
"""

from __future__ import annotations

import torch

from hydra_jury.kernels.native import native


def row_kernels(*tensors: torch.Tensor):
    """`torch.ops.hydra_jury` when the kernels are loaded and take every tensor (float32,
    on the CPU, no gradient, rows of at least one entry); else None."""
    for tensor in tensors:
        if (
            tensor.dtype != torch.float32
            or tensor.device.type != "cpu"
            or tensor.dim() == 0
            or tensor.shape[-1] == 0
            or tensor.requires_grad
        ):
            return None
    return native()
