"""A readable summary of a Hydra checkpoint, read from its manifest and tensor headers
(no weights are loaded)."""

from __future__ import annotations

import math
from pathlib import Path

from hydra_jury.hydra_model.checkpoint import DTYPES, TRUNK_FILE, read_manifest, tensor_shapes
from hydra_jury.hydra_model.kv_cache import bytes_per_position


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def describe_checkpoint(directory: str | Path) -> str:
    directory = Path(directory)
    manifest = read_manifest(directory)
    config = manifest.decoder
    dtype = DTYPES[manifest.dtype]
    itemsize = dtype.itemsize

    def params(path: Path) -> int:
        return sum(math.prod(shape) for shape in tensor_shapes(path).values())

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
    trunk_params = params(directory / TRUNK_FILE)
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
        "",
        f"{'component':<16}{'role':<13}{'lm head':<11}{'params':>14}{'weights':>14}"
        f"{'KV/token':>12}  source",
        f"{'trunk':<16}{'':<13}{'':<11}{trunk_params:>14,}"
        f"{_mib(trunk_params * itemsize):>14}{kv_trunk:>10,} B",
    ]
    total = trunk_params
    for head in manifest.heads:
        count = params(directory / head.file)
        total += count
        lines.append(
            f"{head.name:<16}{head.role:<13}{head.lm_head:<11}{count:>14,}"
            f"{_mib(count * itemsize):>14}{kv_head:>10,} B  {head.source}"
        )
    kv_all = kv_trunk + kv_head * len(manifest.heads)
    lines += [
        f"{'total':<40}{total:>14,}{_mib(total * itemsize):>14}{kv_all:>10,} B",
        "",
        f"KV cache for one session at full context: trunk "
        f"{_mib(kv_trunk * config.max_position_embeddings)}, each head "
        f"{_mib(kv_head * config.max_position_embeddings)}",
    ]
    return "\n".join(lines)
