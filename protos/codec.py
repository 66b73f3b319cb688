"""Tensors to and from `hydrajury.v1.Tensor` messages, with every size validated.

A received tensor is checked for dtype, rank, each dimension the receiver knows, and the
exact byte length before any bytes become a tensor, so a malformed message is a
readable `CodecError` (INVALID_ARGUMENT) instead of a failure inside torch. Never pickle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hydra_jury.protos.hydrajury.v1 import tensor_pb2

# dtypes a tensor may travel in, named as torch names them (`torch.float32` → "float32").
WIRE_DTYPES = frozenset({"float32", "bfloat16", "float16", "int64"})


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


class CodecError(ValueError):
    """A tensor message that does not match what the receiver expects."""


def tensor_to_pb(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    tensor = tensor.detach().to("cpu").contiguous()
    name = dtype_name(tensor.dtype)
    if name not in WIRE_DTYPES:
        raise CodecError(f"cannot send dtype {tensor.dtype}")
    # Flattened first: a "contiguous" tensor with a size-1 dimension may keep an odd stride.
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return tensor_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=data)


def tensor_from_pb(
    message: tensor_pb2.Tensor,
    *,
    name: str,
    dtypes: Sequence[str],
    shape: Sequence[int | None],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Decodes `message`, requiring a dtype in `dtypes` and `shape` (None: any size)."""
    if message.dtype not in dtypes or message.dtype not in WIRE_DTYPES:
        raise CodecError(
            f"{name}: dtype {message.dtype!r} is not accepted here; expected {' or '.join(dtypes)}"
        )
    found = tuple(message.shape)
    if len(found) != len(shape) or any(
        want is not None and got != want for got, want in zip(found, shape, strict=False)
    ):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise CodecError(f"{name}: shape {list(found)} does not match [{wanted}]")
    if any(size < 0 for size in found):
        raise CodecError(f"{name}: negative size in shape {list(found)}")
    dtype = getattr(torch, message.dtype)  # one of WIRE_DTYPES, checked above
    expected_bytes = math.prod(found) * dtype.itemsize
    if len(message.data) != expected_bytes:
        raise CodecError(
            f"{name}: {len(message.data)} bytes of data, but shape {list(found)} "
            f"of {message.dtype} needs {expected_bytes}"
        )
    if expected_bytes == 0:
        return torch.empty(found, dtype=dtype, device=device)
    flat = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(found).to(device)


def optional_tensor_to_pb(tensor: torch.Tensor | None) -> tensor_pb2.Tensor | None:
    return None if tensor is None else tensor_to_pb(tensor)


def split_rows(message: tensor_pb2.Tensor, rows: int) -> list[tensor_pb2.Tensor]:
    """`message` cut along its first dimension into pieces of at most `rows` rows,
    without decoding it. A message whose bytes do not match its shape is returned whole,
    for the receiver's decoding to refuse."""
    found = tuple(message.shape)
    if not found or message.dtype not in WIRE_DTYPES or found[0] <= rows or min(found) < 0:
        return [message]
    row_bytes = math.prod(found[1:]) * getattr(torch, message.dtype).itemsize
    if len(message.data) != found[0] * row_bytes:
        return [message]
    return [
        tensor_pb2.Tensor(
            dtype=message.dtype,
            shape=[min(rows, found[0] - start), *found[1:]],
            data=message.data[start * row_bytes : (start + rows) * row_bytes],
        )
        for start in range(0, found[0], rows)
    ]


def concat_rows(messages: Sequence[tensor_pb2.Tensor]) -> tensor_pb2.Tensor:
    """Messages of one dtype and row shape joined along their first dimension, without
    decoding them (the inverse of `split_rows`)."""
    first = messages[0]
    return tensor_pb2.Tensor(
        dtype=first.dtype,
        shape=[sum(message.shape[0] for message in messages), *first.shape[1:]],
        data=b"".join(message.data for message in messages),
    )
