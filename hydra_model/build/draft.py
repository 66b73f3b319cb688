"""Draft models for speculative decoding: any causal LM the builder reads, as a Hydra
checkpoint whose trunk and first `llm` head together form the whole model.

A Hugging Face directory or GGUF file is converted once into a cache directory, under a
key derived from the source's path, file sizes and modification times: an unchanged
source reuses its checkpoint, a changed one gets a new one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from hydra_jury.hydra_model.build.builder import (
    BuildError,
    BuildOptions,
    build_checkpoint,
    read_source,
)
from hydra_jury.hydra_model.checkpoint import MANIFEST, CheckpointError, read_manifest

CACHE_VARIABLE = "HYDRA_JURY_CACHE"
CACHE_SUBDIR = "draft-models"


def default_draft_cache() -> Path:
    """`$HYDRA_JURY_CACHE/draft-models`, else `~/.cache/hydra-jury/draft-models`."""
    root = os.environ.get(CACHE_VARIABLE)
    base = Path(root) if root else Path.home() / ".cache" / "hydra-jury"
    return base / CACHE_SUBDIR


def resolve_draft_model(
    source: str | Path, cache_dir: Path, log: Callable[[str], None] = print
) -> Path:
    """A Hydra checkpoint directory for the draft model `source`: `source` itself if it is
    one, else its conversion in `cache_dir` (built on first use)."""
    path = Path(source)
    if not path.exists():
        raise BuildError(
            f"draft model {path}: no such file or directory (expected a Hydra checkpoint, "
            f"a Hugging Face model directory or a .gguf file)"
        )
    if (path / MANIFEST).is_file():
        try:
            read_manifest(path)
        except CheckpointError as error:
            raise BuildError(f"draft model: {error}") from None
        return path
    if not (path.is_dir() or path.suffix == ".gguf"):
        raise BuildError(
            f"draft model {path}: not a Hydra checkpoint, a Hugging Face model directory "
            f"or a .gguf file"
        )
    out = cache_dir / _cache_key(path)
    if _is_checkpoint(out):
        log(f"draft model {path}: reusing {out}")
        return out
    log(f"draft model {path}: converting into {out} (once)")
    loaded = read_source(path)
    build_checkpoint(
        BuildOptions(
            source=str(path),
            out=str(out),
            # Any split will do: the draft model is the trunk and its one head in a row.
            trunk_layers=loaded.config.num_layers - 1,
            heads=1,
            dtype="float32",
            force=True,  # a broken conversion left at `out` is replaced
        ),
        log=lambda line: None,
        loaded=loaded,
    )
    return out


def _cache_key(path: Path) -> str:
    """`<name>-<sha256 prefix>` over the resolved path and each source file's size and
    modification time: any rewrite of the source changes it."""
    resolved = path.resolve()
    # Only the top level: the builder reads nothing from subdirectories.
    files = [resolved]
    if resolved.is_dir():
        files = sorted(f for f in resolved.iterdir() if f.is_file())
    digest = hashlib.sha256(str(resolved).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"\0{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return f"{resolved.stem}-{digest.hexdigest()[:16]}"


def _is_checkpoint(directory: Path) -> bool:
    try:
        read_manifest(directory)
    except CheckpointError:
        return False
    return True
