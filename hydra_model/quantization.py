"""Weight quantization: int8 with a scale per output channel, int4 with a scale and a
minimum per group of inputs (the layout of llama.cpp's Q4_1).

A product with a quantized weight takes its activations one of two ways (the scheme's
`activations`): in float32, or quantized to int8 per block of 32 inputs as llama.cpp's
Q8_0 does, so that the kernels multiply in integers (`int8_activations`). Either way the
checkpoint stores only the weights, and the quantized model is a model of its own —
speculative decoding and the Product of Experts are exact with respect to its
distributions, not float32's.

int8:  w[o, k] = q[o, k] * scale[o],          q in -127..127
int4:  w[o, k] = q[o, k] * scale[o, g] + min[o, g] for the group g = k // group_size,
       q in 0..15, packed two to a byte: in each block of 32 inputs, byte j holds
       input j in its low nibble and input j + 16 in its high one (what the kernels load).
int8 activations: x[k] = q[k] * d for the block b = k // 32, d = max|x_b| / 127,
       q = round(x * (127 / max|x_b|)) in -127..127.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

METHODS = ("int8", "int4")
ACTIVATIONS = ("int8", "float")
DEFAULT_GROUP_SIZE = 32
ACTIVATION_BLOCK = 32
# Checkpoint tensor names: the quantized values keep the weight's name.
SCALE_SUFFIX = "_scale"
MINIMUM_SUFFIX = "_min"


class QuantizationError(ValueError):
    """A quantization that cannot be made or loaded; the message says why."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [..., outputs, inputs] stored quantized. Leading dimensions (a stack of
    heads) are shared by every field; `data` is int8 [..., outputs, inputs] or packed
    uint8 [..., outputs, inputs / 2]."""

    data: torch.Tensor
    scale: torch.Tensor  # int8: [..., outputs]; int4: [..., outputs, groups]
    minimum: torch.Tensor | None = None  # int4 only
    group_size: int = 0  # int4 only
    int8_activations: bool = False  # products quantize their activations to int8 first

    @property
    def method(self) -> str:
        return "int8" if self.minimum is None else "int4"

    @property
    def shape(self) -> tuple[int, ...]:
        if self.minimum is None:
            return tuple(self.data.shape)
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    @property
    def requires_grad(self) -> bool:
        return False

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.minimum) if t is not None]

    def __getitem__(self, index) -> QuantizedWeight:
        """Members of a stack (an index into the leading dimensions), without a copy."""
        minimum = None if self.minimum is None else self.minimum[index]
        return QuantizedWeight(
            self.data[index], self.scale[index], minimum, self.group_size, self.int8_activations
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.minimum is None:
            return (self.data.float() * self.scale[..., None]).to(dtype)
        values = unpack_int4(self.data).float()
        scale = self.scale.repeat_interleave(self.group_size, dim=-1)
        minimum = self.minimum.repeat_interleave(self.group_size, dim=-1)
        return torch.addcmul(minimum, values, scale).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` of a 2-D weight, dequantized: an embedding lookup."""
        return self[index].dequantize(dtype)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., inputs] (inputs a multiple of 32) as a product with `int8_activations` reads
    it: each block of 32 quantized to int8 and back, in float32 — the d and q the kernels
    compute, so that PyTorch's products (prefills, machines without the kernels) differ
    from theirs only by float rounding."""
    blocks = x.float().unflatten(-1, (-1, ACTIVATION_BLOCK))
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q * (largest / 127)).flatten(-2).to(x.dtype)


def tensors_of(weight: torch.Tensor | QuantizedWeight) -> list[torch.Tensor]:
    """The tensors that hold a weight (for byte counts)."""
    return weight.tensors() if isinstance(weight, QuantizedWeight) else [weight]


def quantize(
    weight: torch.Tensor,
    method: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    int8_activations: bool = False,
):
    """A float weight [..., outputs, inputs] -> QuantizedWeight."""
    weight = weight.float()
    inputs = weight.shape[-1]
    if int8_activations:
        check_activation_width(inputs)
    if method == "int8":
        scale = weight.abs().amax(dim=-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        data = torch.round(weight / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(data, scale, int8_activations=int8_activations)
    if method != "int4":
        raise QuantizationError(f"unknown quantization {method!r}; expected one of {METHODS}")
    check_group_size(group_size, inputs)
    groups = weight.unflatten(-1, (inputs // group_size, group_size))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return QuantizedWeight(pack_int4(values.flatten(-2)), scale, low, group_size, int8_activations)


def check_group_size(group_size: int, inputs: int) -> None:
    if group_size <= 0 or group_size % 32:
        raise QuantizationError(f"the int4 group size must be a multiple of 32, not {group_size}")
    if inputs % group_size:
        raise QuantizationError(
            f"the int4 group size {group_size} does not divide a weight's {inputs} inputs "
            f"(choose a group size that divides every layer's input size)"
        )


def check_activation_width(inputs: int, name: str = "a weight") -> None:
    if inputs % ACTIVATION_BLOCK:
        raise QuantizationError(
            f"int8 activations come in blocks of {ACTIVATION_BLOCK}: {name} has {inputs} "
            "inputs, not a multiple (use --activations float)"
        )


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[..., inputs] of 0..15 (inputs a multiple of 32) -> uint8 [..., inputs / 2]."""
    blocks = values.to(torch.uint8).unflatten(-1, (-1, 2, 16))
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).flatten(-2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., inputs / 2] -> uint8 [..., inputs] of 0..15 (inverse of pack_int4)."""
    blocks = packed.unflatten(-1, (-1, 16))
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-2).flatten(-3)


def stack(weights: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """torch.stack for float and quantized weights alike (a stack of heads)."""
    first = weights[0]
    if not isinstance(first, QuantizedWeight):
        return torch.stack(list(weights))
    minimum = None if first.minimum is None else torch.stack([w.minimum for w in weights])
    return QuantizedWeight(
        torch.stack([w.data for w in weights]),
        torch.stack([w.scale for w in weights]),
        minimum,
        first.group_size,
        first.int8_activations,
    )


def cat_outputs(
    weights: Sequence[torch.Tensor | QuantizedWeight],
) -> torch.Tensor | QuantizedWeight:
    """The outputs of several weights as one (q, k and v; gate and up)."""
    first = weights[0]
    if not isinstance(first, QuantizedWeight):
        return torch.cat(list(weights), dim=-2)
    per_channel = first.minimum is None
    minimum = None if per_channel else torch.cat([w.minimum for w in weights], dim=-2)
    return QuantizedWeight(
        torch.cat([w.data for w in weights], dim=-2),
        torch.cat([w.scale for w in weights], dim=-1 if per_channel else -2),
        minimum,
        first.group_size,
        first.int8_activations,
    )


@dataclass(frozen=True)
class QuantizationScheme:
    """How a checkpoint's weights are stored (the manifest's `quantization`): every
    projection of every layer, and with `output_matrix` the embedding and LM heads too;
    and how their products take activations (`activations`: int8 or float). A manifest
    written before `activations` existed means float."""

    method: str
    group_size: int = 0  # int4 only
    output_matrix: bool = True
    activations: str = "float"

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "group_size": self.group_size,
            "output_matrix": self.output_matrix,
            "activations": self.activations,
        }

    @classmethod
    def from_dict(cls, data: object) -> QuantizationScheme:
        fields = {"method", "group_size", "output_matrix", "activations"}
        if not isinstance(data, dict) or set(data) - fields:
            raise QuantizationError(
                f"malformed quantization {data!r}; expected method, group_size, output_matrix, "
                "activations"
            )
        scheme = cls(
            data.get("method"),
            data.get("group_size", 0),
            data.get("output_matrix", True),
            data.get("activations", "float"),
        )
        if scheme.activations not in ACTIVATIONS:
            raise QuantizationError(
                f"unknown quantization activations {scheme.activations!r}; expected one of "
                f"{ACTIVATIONS}"
            )
        if scheme.method not in METHODS:
            raise QuantizationError(
                f"unknown quantization method {scheme.method!r}; expected one of {METHODS}"
            )
        if not isinstance(scheme.output_matrix, bool):
            raise QuantizationError("quantization output_matrix must be true or false")
        if scheme.method == "int8" and scheme.group_size != 0:
            raise QuantizationError("int8 has a scale per output channel: group_size must be 0")
        if scheme.method == "int4":
            check_group_size(scheme.group_size, scheme.group_size or 1)
        return scheme

    @classmethod
    def from_flags(
        cls, method: str, group_size: int, keep_output_matrix: bool, activations: str = "int8"
    ) -> QuantizationScheme:
        """The scheme `--quantize`, `--group-size`, `--keep-output-matrix` and
        `--activations` ask for."""
        return cls.from_dict(
            {
                "method": method,
                "group_size": group_size if method == "int4" else 0,
                "output_matrix": not keep_output_matrix,
                "activations": activations,
            }
        )

    @property
    def int8_activations(self) -> bool:
        return self.activations == "int8"

    def covers(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` is stored quantized."""
        if name.endswith("_proj.weight"):
            return True
        return self.output_matrix and name in ("embed_tokens.weight", "lm_head.weight")

    def stored_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The float names and shapes of a file -> what this scheme stores instead."""
        stored: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            if not self.covers(name):
                stored[name] = shape
                continue
            outputs, inputs = shape
            if self.int8_activations:
                check_activation_width(inputs, name)
            if self.method == "int8":
                stored[name] = shape
                stored[name + SCALE_SUFFIX] = (outputs,)
            else:
                check_group_size(self.group_size, inputs)
                stored[name] = (outputs, inputs // 2)
                stored[name + SCALE_SUFFIX] = (outputs, inputs // self.group_size)
                stored[name + MINIMUM_SUFFIX] = (outputs, inputs // self.group_size)
        return stored

    def exact_names(self, shapes: dict[str, tuple[int, ...]]) -> frozenset[str]:
        """Stored tensors that keep their own dtype whatever the compute dtype."""
        return frozenset(n for n in self.stored_shapes(shapes) if self.covers(_weight_name(n)))

    def quantize_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A file's float tensors -> the tensors this scheme stores."""
        stored = {}
        for name, tensor in tensors.items():
            if not self.covers(name):
                stored[name] = tensor
                continue
            weight = quantize(tensor, self.method, self.group_size, self.int8_activations)
            stored[name] = weight.data
            stored[name + SCALE_SUFFIX] = weight.scale
            if weight.minimum is not None:
                stored[name + MINIMUM_SUFFIX] = weight.minimum
        return stored

    def assemble(self, stored: dict[str, torch.Tensor], where: str) -> dict[str, object]:
        """Stored tensors (as `stored_shapes` names them) -> weights: QuantizedWeight for
        the covered ones. Checks the stored dtypes."""
        weights: dict[str, object] = {}
        data_dtype = torch.int8 if self.method == "int8" else torch.uint8
        for name, tensor in stored.items():
            if name.endswith((SCALE_SUFFIX, MINIMUM_SUFFIX)) and self.covers(_weight_name(name)):
                continue
            if not self.covers(name):
                weights[name] = tensor
                continue
            parts = [stored[name + SCALE_SUFFIX]]
            if self.method == "int4":
                parts.append(stored[name + MINIMUM_SUFFIX])
            if tensor.dtype != data_dtype or any(p.dtype != torch.float32 for p in parts):
                raise QuantizationError(
                    f"{where}: {name} is stored as {tensor.dtype} with float scales expected; "
                    f"a {self.method} checkpoint stores {data_dtype} values and float32 scales"
                )
            weights[name] = QuantizedWeight(
                tensor,
                *parts,
                group_size=self.group_size if self.method == "int4" else 0,
                int8_activations=self.int8_activations,
            )
        return weights


def _weight_name(part: str) -> str:
    for suffix in (SCALE_SUFFIX, MINIMUM_SUFFIX):
        if part.endswith(suffix):
            return part[: -len(suffix)]
    return part
