"""The Hydra checkpoint format: reading, validating and writing it.

A checkpoint is a directory:

    hydra.json                 manifest: format_version, decoder config, trunk_layers,
                               dtype, heads (name, role, where its LM head lives)
    trunk.safetensors          embed_tokens.weight, layers.{0..K-1}.*, and lm_head.weight
                               when heads share one LM head that is not the embedding
    heads/<name>.safetensors   layers.{K..L-1}.*, norm.weight, and lm_head.weight when the
                               head has its own
    tokenizer files            as written by `save_pretrained` (with the chat template)

A head's `lm_head` is "embedding" (tied to the trunk's embedding), "shared" (the one in
trunk.safetensors) or "own" (in its file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hydra_jury.hydra_model.config import ConfigError, DecoderConfig
from hydra_jury.hydra_model.layers import layer_tensor_shapes
from hydra_jury.hydra_model.quantization import QuantizationError, QuantizationScheme

FORMAT_VERSION = 1
MANIFEST = "hydra.json"
TRUNK_FILE = "trunk.safetensors"
HEADS_DIR = "heads"
ROLES = ("llm", "uncertainty")
LM_HEAD_PLACES = ("embedding", "shared", "own")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Written beside them by a tokenizer that has a chat template (SmolLM2's); not required.
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class CheckpointError(ValueError):
    """A Hydra checkpoint that cannot be loaded; the message names the file and problem."""


@dataclass(frozen=True)
class HeadSpec:
    name: str
    role: str = "llm"
    lm_head: str = "embedding"
    source: str = ""

    @property
    def file(self) -> str:
        return f"{HEADS_DIR}/{self.name}.safetensors"


@dataclass(frozen=True)
class Manifest:
    decoder: DecoderConfig
    trunk_layers: int
    heads: tuple[HeadSpec, ...]
    dtype: str = "float32"
    format_version: int = FORMAT_VERSION
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    quantization: QuantizationScheme | None = None  # None: float weights

    @property
    def llm_heads(self) -> tuple[HeadSpec, ...]:
        return tuple(h for h in self.heads if h.role == "llm")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "source": self.source,
            "dtype": self.dtype,
            "trunk_layers": self.trunk_layers,
            "decoder": self.decoder.to_dict(),
            "heads": [vars(h) for h in self.heads],
            **({} if self.quantization is None else {"quantization": self.quantization.to_dict()}),
            **self.extra,
        }

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        config = self.decoder
        shapes = {"embed_tokens.weight": (config.vocab_size, config.hidden_size)}
        shapes.update(_layer_shapes(config, range(self.trunk_layers)))
        if any(h.lm_head == "shared" for h in self.heads):
            shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        return shapes

    def head_shapes(self, head: HeadSpec) -> dict[str, tuple[int, ...]]:
        config = self.decoder
        shapes = _layer_shapes(config, range(self.trunk_layers, config.num_layers))
        shapes["norm.weight"] = (config.hidden_size,)
        if head.lm_head == "own":
            shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        return shapes


def _layer_shapes(config: DecoderConfig, layers: range) -> dict[str, tuple[int, ...]]:
    per_layer = layer_tensor_shapes(config)
    return {f"layers.{i}.{name}": shape for i in layers for name, shape in per_layer.items()}


def parse_manifest(data: dict[str, Any], where: str = MANIFEST) -> Manifest:
    """Validates a manifest dictionary; every error names `where` and the problem."""
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: unsupported format_version {version!r}; this build reads version "
            f"{FORMAT_VERSION} (rebuild the checkpoint with `hydra-jury build`)"
        )
    try:
        decoder = DecoderConfig.from_dict(data["decoder"])
    except ConfigError as error:
        raise CheckpointError(f"{where}: {error}") from None
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{where}: malformed decoder config ({error})") from None
    trunk_layers = data.get("trunk_layers")
    if not isinstance(trunk_layers, int) or not 1 <= trunk_layers < decoder.num_layers:
        raise CheckpointError(
            f"{where}: trunk_layers={trunk_layers!r} is out of range; it must be between 1 "
            f"and {decoder.num_layers - 1} (the decoder has {decoder.num_layers} layers and "
            f"each head needs at least one)"
        )
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    heads = []
    for raw in data.get("heads") or []:
        try:
            head = HeadSpec(**raw)
        except TypeError as error:
            raise CheckpointError(f"{where}: malformed head entry {raw!r} ({error})") from None
        if head.role not in ROLES:
            raise CheckpointError(
                f"{where}: head {head.name!r} has unknown role {head.role!r}; "
                f"expected one of {ROLES}"
            )
        if head.lm_head not in LM_HEAD_PLACES:
            raise CheckpointError(
                f"{where}: head {head.name!r} has lm_head={head.lm_head!r}; "
                f"expected one of {LM_HEAD_PLACES}"
            )
        if not head.name or "/" in head.name or head.name.startswith("."):
            raise CheckpointError(f"{where}: invalid head name {head.name!r}")
        heads.append(head)
    names = [h.name for h in heads]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{where}: duplicate head names in {names}")
    if not any(h.role == "llm" for h in heads):
        raise CheckpointError(f"{where}: the checkpoint has no head of role 'llm'")
    quantization = None
    if "quantization" in data:
        try:
            quantization = QuantizationScheme.from_dict(data["quantization"])
            quantization.stored_shapes(layer_tensor_shapes(decoder))  # the group size fits
        except QuantizationError as error:
            raise CheckpointError(f"{where}: {error}") from None
    known = {"format_version", "source", "dtype", "trunk_layers", "decoder", "heads"}
    known.add("quantization")
    return Manifest(
        decoder=decoder,
        trunk_layers=trunk_layers,
        heads=tuple(heads),
        dtype=dtype,
        source=data.get("source", ""),
        extra={k: v for k, v in data.items() if k not in known},
        quantization=quantization,
    )


def checkpoint_fingerprint(directory: str | Path) -> str:
    """sha256 of hydra.json: services built from the same checkpoint share it."""
    return hashlib.sha256((Path(directory) / MANIFEST).read_bytes()).hexdigest()


def read_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (expected a Hydra checkpoint)")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {directory} is not a Hydra checkpoint "
            f"(build one with `hydra-jury build`)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    manifest = parse_manifest(data, str(path))
    for name in (TRUNK_FILE, *(h.file for h in manifest.heads), *TOKENIZER_FILES):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing file of the Hydra checkpoint")
    return manifest


def read_tensors(
    path: Path,
    expected: dict[str, tuple[int, ...]],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    note: str = "",
    exact: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Loads a safetensors file, checking that it holds exactly the expected names/shapes.
    Tensors are converted to `dtype`, except those named in `exact` (quantized values and
    their scales)."""
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path}: cannot be read as safetensors ({error})") from None
    with handle as tensors_file:
        names = set(tensors_file.keys())
        missing = sorted(set(expected) - names)
        if missing:
            raise CheckpointError(
                f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        unexpected = sorted(names - set(expected))
        if unexpected:
            raise CheckpointError(
                f"{path}: unexpected tensors {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}"
            )
        tensors = {}
        for name, shape in expected.items():
            found = tuple(tensors_file.get_slice(name).get_shape())
            if found != shape:
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {found}, expected {shape} from the "
                    f"decoder config{note}"
                )
            tensor = tensors_file.get_tensor(name)
            tensors[name] = tensor if dtype is None or name in exact else tensor.to(dtype)
    return tensors


HEAD_SHAPE_NOTE = " (every head must have the same shapes as the decoder and the other heads)"


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes in a safetensors file, without loading the data."""
    with safe_open(str(path), framework="pt") as tensors_file:
        return {
            name: tuple(tensors_file.get_slice(name).get_shape()) for name in tensors_file.keys()
        }


def split_layers(tensors: dict[str, torch.Tensor], layers: range) -> list[dict[str, torch.Tensor]]:
    """{'layers.3.q_proj.weight': t, ...} -> [{'q_proj.weight': t, ...} per layer]."""
    return [
        {
            name[len(f"layers.{i}.") :]: t
            for name, t in tensors.items()
            if name.startswith(f"layers.{i}.")
        }
        for i in layers
    ]


def training_summary(directory: str | Path) -> str:
    """What the checkpoint's heads have learned, in a few words, for the servers' ready
    lines: a newly built split serves heads that are copies of one model."""
    extra = read_manifest(directory).extra
    summary = "heads trained" if "training" in extra else "heads untrained"
    if "uncertainty_training" in extra:
        summary += ", uncertainty head trained"
    return summary
