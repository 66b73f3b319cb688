"""A readable summary of a Hydra checkpoint, read from its manifest and tensor headers
(no weights are loaded)."""

from __future__ import annotations

import math
from pathlib import Path

from hydra_jury.hydra_model.checkpoint import DTYPES, TRUNK_FILE, read_manifest
from hydra_jury.hydra_model.kv_cache import bytes_per_position


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def describe_checkpoint(directory: str | Path) -> str:
    directory = Path(directory)
    manifest = read_manifest(directory)
    config = manifest.decoder
    dtype = DTYPES[manifest.dtype]

    def params(shapes: dict[str, tuple[int, ...]]) -> int:
        return sum(math.prod(shape) for shape in shapes.values())

    def stored(path: Path) -> str:  # what the file holds: quantized weights are smaller
        return _mib(path.stat().st_size)

    head_layers = config.num_layers - manifest.trunk_layers
    kv_trunk = bytes_per_position(
        stack=1,
        layers=manifest.trunk_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    kv_head = bytes_per_position(
        stack=1,
        layers=head_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    trunk_params = params(manifest.trunk_shapes())
    scheme = manifest.quantization
    if scheme is None:
        weights = "float (no quantization)"
    else:
        group = f", groups of {scheme.group_size}" if scheme.method == "int4" else ""
        output = "quantized" if scheme.output_matrix else "kept float"
        weights = (
            f"{scheme.method}{group}; embedding and LM heads {output}; "
            f"{scheme.activations} activations"
        )
    lines = [
        f"checkpoint   {directory}",
        f"source       {manifest.source}",
        f"architecture {config.model_type} (family {config.family}), vocabulary "
        f"{config.vocab_size}, hidden {config.hidden_size}, MLP {config.intermediate_size}",
        f"attention    {config.num_attention_heads} query heads, "
        f"{config.num_key_value_heads} key/value heads of {config.head_dim}, rope theta "
        f"{config.rope_theta:g}{' ' + str(config.rope_scaling) if config.rope_scaling else ''}",
        f"context      {config.max_position_embeddings} positions",
        f"layers       {config.num_layers}: trunk 0..{manifest.trunk_layers - 1}, "
        f"heads {manifest.trunk_layers}..{config.num_layers - 1}",
        f"dtype        {manifest.dtype}",
        f"weights      {weights}",
        "",
        f"{'component':<16}{'role':<13}{'lm head':<11}{'params':>14}{'weights':>14}"
        f"{'KV/token':>12}  source",
        f"{'trunk':<16}{'':<13}{'':<11}{trunk_params:>14,}"
        f"{stored(directory / TRUNK_FILE):>14}{kv_trunk:>10,} B",
    ]
    total = trunk_params
    total_bytes = (directory / TRUNK_FILE).stat().st_size
    for head in manifest.heads:
        count = params(manifest.head_shapes(head))
        total += count
        total_bytes += (directory / head.file).stat().st_size
        lines.append(
            f"{head.name:<16}{head.role:<13}{head.lm_head:<11}{count:>14,}"
            f"{stored(directory / head.file):>14}{kv_head:>10,} B  {head.source}"
        )
    kv_all = kv_trunk + kv_head * len(manifest.heads)
    lines += [
        f"{'total':<40}{total:>14,}{_mib(total_bytes):>14}{kv_all:>10,} B",
        "",
        f"KV cache for one session at full context: trunk "
        f"{_mib(kv_trunk * config.max_position_embeddings)}, each head "
        f"{_mib(kv_head * config.max_position_embeddings)}",
    ]
    return "\n".join(lines)
