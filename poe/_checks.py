"""Shape and dtype checks shared by the `poe` modules.

Terms
- B: rows (positions or requests) in a batch; N is used for the same where a module
  speaks of positions.
- V: vocabulary size.

Only shapes and dtypes are checked: they are free to read. Value checks (token ids in
range, probabilities non-negative) would force a device synchronisation on every call,
so they are left to the functions that synchronise anyway.
"""

from __future__ import annotations

import torch


def check_float(name: str, tensor: torch.Tensor, dims: int) -> None:
    """Raises ValueError unless `tensor` is a floating-point tensor with `dims` dimensions."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {_describe(tensor)}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(tensor.shape)}")


def check_long(name: str, tensor: torch.Tensor, dims: int) -> None:
    """Raises ValueError unless `tensor` is an int64 tensor with `dims` dimensions."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.long:
        raise ValueError(f"{name} must be an int64 (long) tensor, got {_describe(tensor)}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(tensor.shape)}")


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    """Raises ValueError unless every tensor in `others` has the shape of `reference`."""
    for name, tensor in others.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {list(tensor.shape)} but {reference_name} has shape "
                f"{list(reference.shape)}; they must match"
            )


def check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    """Raises ValueError unless the first dimension of `tensor` is `rows`."""
    if tensor.shape[0] != rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {rows}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in float32: itself when it is already (`.float()` would still make a
    dispatcher call, which costs more than its work right after a model step has pushed
    the interpreter out of the caches)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()
