"""Building a Hydra checkpoint from a Hugging Face model (directory or GGUF file).

Head i is, in this order: the top layers of the i-th `--head-from` checkpoint (a full
fine-tune of the same architecture); then the base top layers with the next `--lora`
adapter merged; then plain copies of the base top layers. An optional extra head of
role `uncertainty` starts as a copy of the base top layers. With `layers` set, only the
source's first layers are kept (an early-exit model, e.g. a cheap draft model): the final
norm and LM head then follow the last kept layer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from hydra_jury.hydra_model.build.lora import lora_deltas
from hydra_jury.hydra_model.build.sources import SourceError, SourceModel, load_source
from hydra_jury.hydra_model.checkpoint import (
    DTYPES,
    FORMAT_VERSION,
    HEADS_DIR,
    MANIFEST,
    TRUNK_FILE,
    HeadSpec,
    Manifest,
)
from hydra_jury.hydra_model.config import DecoderConfig
from hydra_jury.hydra_model.layers import layer_tensor_shapes
from hydra_jury.hydra_model.quantization import (
    DEFAULT_GROUP_SIZE,
    QuantizationError,
    QuantizationScheme,
)


class BuildError(ValueError):
    """Bad builder arguments or sources; the message says what to change."""


@dataclass
class BuildOptions:
    source: str
    out: str
    trunk_layers: int
    heads: int
    head_from: list[str] = field(default_factory=list)
    lora: list[str] = field(default_factory=list)
    uncertainty_head: bool = False
    dtype: str = "float32"
    force: bool = False
    layers: int | None = None  # keep only the source's first N layers
    quantize: str | None = None  # "int8" or "int4" (hydra_model.quantization)
    group_size: int = DEFAULT_GROUP_SIZE  # int4's inputs per scale and minimum
    keep_output_matrix: bool = False  # embedding and LM heads stay float
    activations: str = "int8"  # how quantized products take their inputs: int8 or float

    def quantization(self) -> QuantizationScheme | None:
        """The scheme the options ask for (None: float weights); QuantizationError if it
        cannot be made."""
        if self.quantize is None:
            return None
        return QuantizationScheme.from_flags(
            self.quantize, self.group_size, self.keep_output_matrix, self.activations
        )


def _same_architecture(base: SourceModel, other: SourceModel) -> bool:
    def shape(config) -> tuple:
        return (
            config.family,
            config.vocab_size,
            config.hidden_size,
            config.intermediate_size,
            config.num_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )

    return shape(base.config) == shape(other.config)


def build_checkpoint(
    options: BuildOptions,
    log: Callable[[str], None] = print,
    *,
    loaded: SourceModel | None = None,
) -> Manifest:
    """Writes the checkpoint; `loaded` is `options.source` already read by the caller
    (reading a GGUF file dequantizes the whole model, so it is done once)."""
    out = Path(options.out)
    _check_options(options, out)
    dtype = DTYPES[options.dtype]
    base = loaded
    if base is None:
        log(f"reading {options.source}")
        base = read_source(options.source)
    config = _kept_layers(base.config, options.layers)
    k = options.trunk_layers
    if not 1 <= k < config.num_layers:
        kept = "the model has" if options.layers is None else "--layers keeps"
        raise BuildError(
            f"--trunk-layers {k} is out of range: {kept} "
            f"{config.num_layers} layers, so it must be 1..{config.num_layers - 1}"
        )
    if base.save_tokenizer is None:
        raise BuildError(f"{options.source}: no tokenizer files next to the model")
    shapes = layer_tensor_shapes(config)
    head_layers = range(k, config.num_layers)
    try:
        scheme = options.quantization()
        if scheme is not None:
            scheme.stored_shapes(shapes)  # the group size divides every layer's inputs
    except QuantizationError as error:
        raise BuildError(str(error)) from None

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        embedding = base.tensor("embed_tokens.weight")
        base_lm_head = base.tensor("lm_head.weight")
        trunk = {"embed_tokens.weight": embedding}
        for i in range(k):
            trunk.update({f"layers.{i}.{n}": t for n, t in base.layer(i, shapes).items()})
        (staging / HEADS_DIR).mkdir()
        specs: list[HeadSpec] = []
        shared_lm_head = False
        plan = _head_plan(options)
        for index, (name, role, kind, origin) in enumerate(plan):
            log(f"head {index + 1}/{len(plan)} {name!r} ({role}): {kind} {origin}".rstrip())
            source = base
            if kind == "from":
                source = read_source(origin)
                if not _same_architecture(base, source):
                    raise BuildError(
                        f"--head-from {origin}: its architecture differs from "
                        f"{options.source} (heads must share the trunk's shapes)"
                    )
            tensors = {}
            for i in head_layers:
                tensors.update({f"layers.{i}.{n}": t for n, t in source.layer(i, shapes).items()})
            if kind == "lora":
                try:
                    deltas = lora_deltas(origin, k, config.num_layers)
                except (SourceError, ValueError) as error:
                    raise BuildError(str(error)) from None
                for weight_name, delta in deltas.items():
                    merged = tensors[weight_name].float() + delta
                    tensors[weight_name] = merged.to(tensors[weight_name].dtype)
            tensors["norm.weight"] = source.tensor("norm.weight")
            lm_head = source.tensor("lm_head.weight")
            # Store an LM head once when it is the embedding or the base model's own.
            if torch.equal(lm_head, embedding):
                place = "embedding"
            elif torch.equal(lm_head, base_lm_head):
                place, shared_lm_head = "shared", True
            else:
                place = "own"
                tensors["lm_head.weight"] = lm_head
            save_tensors(tensors, staging / HEADS_DIR / f"{name}.safetensors", dtype, scheme)
            specs.append(
                HeadSpec(name=name, role=role, lm_head=place, source=f"{kind} {origin}".strip())
            )
        if shared_lm_head:
            trunk["lm_head.weight"] = base_lm_head
        log(f"writing trunk ({k} layers)")
        save_tensors(trunk, staging / TRUNK_FILE, dtype, scheme)
        log("writing tokenizer")
        base.save_tokenizer(staging)
        manifest = Manifest(
            decoder=config,
            trunk_layers=k,
            heads=tuple(specs),
            dtype=options.dtype,
            format_version=FORMAT_VERSION,
            source=_source_description(options.source, base.config, config),
            quantization=scheme,
        )
        publish(staging, manifest, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    log(f"done: {out} ({directory_bytes(out) / 2**20:.1f} MiB)")
    return manifest


def publish(staging: Path, manifest: Manifest, out: Path) -> None:
    """Writes the manifest into a checkpoint written whole in `staging` and moves it to
    `out` (replacing what was there): a reader never sees half a checkpoint."""
    (staging / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def read_source(source: str | Path) -> SourceModel:
    """`load_source`, its errors as BuildError."""
    try:
        return load_source(source)
    except (SourceError, ValueError) as error:
        raise BuildError(str(error)) from None


def _kept_layers(source: DecoderConfig, layers: int | None) -> DecoderConfig:
    """The decoder config of the checkpoint: the source's, cut to `layers` if given."""
    if layers is None:
        return source
    # Two at least: the trunk and each head need one layer.
    if not 2 <= layers <= source.num_layers:
        raise BuildError(
            f"--layers {layers} is out of range: the model has {source.num_layers} "
            f"layers, so it must be 2..{source.num_layers}"
        )
    return replace(source, num_layers=layers)


def _source_description(source: str, full: DecoderConfig, kept: DecoderConfig) -> str:
    # The manifest's config alone cannot tell an early-exit model from a small one.
    if kept.num_layers == full.num_layers:
        return str(source)
    return f"{source} (first {kept.num_layers} of {full.num_layers} layers)"


def _check_options(options: BuildOptions, out: Path) -> None:
    if options.dtype not in DTYPES:
        raise BuildError(f"--dtype {options.dtype!r}: expected one of {list(DTYPES)}")
    if options.heads < 1:
        raise BuildError(f"--heads must be at least 1, got {options.heads}")
    special = len(options.head_from) + len(options.lora)
    if special > options.heads:
        raise BuildError(
            f"{len(options.head_from)} --head-from and {len(options.lora)} --lora "
            f"given, but only --heads {options.heads}: each names one head"
        )
    if out.exists() and not options.force:
        raise BuildError(f"{out} already exists; pass --force to overwrite it")


def _head_plan(options: BuildOptions) -> list[tuple[str, str, str, str]]:
    """(name, role, kind, origin) per head; kind is 'from', 'lora' or 'copy'."""
    kinds = [("from", d) for d in options.head_from] + [("lora", d) for d in options.lora]
    kinds += [("copy", "")] * (options.heads - len(kinds))
    plan = [(f"head{i}", "llm", kind, origin) for i, (kind, origin) in enumerate(kinds)]
    if options.uncertainty_head:
        plan.append(("uncertainty", "uncertainty", "copy", ""))
    return plan


def save_tensors(
    tensors: dict[str, torch.Tensor],
    path: Path,
    dtype: torch.dtype,
    scheme: QuantizationScheme | None = None,
) -> None:
    """Writes float tensors in `dtype`, quantizing those `scheme` covers (from the
    tensors as given, not from their `dtype` rounding)."""
    covered = {} if scheme is None else {n: t for n, t in tensors.items() if scheme.covers(n)}
    stored = {name: t.to(dtype) for name, t in tensors.items() if name not in covered}
    if covered:
        stored.update(scheme.quantize_tensors(covered))
    save_file({name: t.contiguous() for name, t in stored.items()}, str(path))


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
