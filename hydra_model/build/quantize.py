"""`hydra-jury quantize`: an existing float checkpoint -> a quantized one
(hydra_model.quantization). `build --quantize` writes one directly."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

from hydra_jury.hydra_model.build.builder import (
    BuildError,
    directory_bytes,
    publish,
    save_tensors,
)
from hydra_jury.hydra_model.checkpoint import (
    DTYPES,
    HEADS_DIR,
    MANIFEST,
    TRUNK_FILE,
    Manifest,
    read_manifest,
)
from hydra_jury.hydra_model.layers import layer_tensor_shapes
from hydra_jury.hydra_model.quantization import QuantizationError, QuantizationScheme


def quantize_checkpoint(
    source: str | Path,
    out: str | Path,
    scheme: QuantizationScheme,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Manifest:
    """Writes `out`: `source` with its weights quantized by `scheme` (written whole
    beside `out`, then moved into place). Raises BuildError, or CheckpointError for a
    source that is not a readable checkpoint."""
    source, out = Path(source), Path(out)
    manifest = read_manifest(source)
    if manifest.quantization is not None:
        raise BuildError(
            f"{source} is already quantized ({manifest.quantization.method}); quantize "
            f"its float checkpoint instead"
        )
    if out.resolve() == source.resolve():
        raise BuildError("--out must be a new directory, not the --checkpoint itself")
    if out.exists() and not force:
        raise BuildError(f"{out} already exists; pass --force to overwrite it")
    try:
        scheme.stored_shapes(layer_tensor_shapes(manifest.decoder))
    except QuantizationError as error:
        raise BuildError(str(error)) from None
    dtype = DTYPES[manifest.dtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / HEADS_DIR).mkdir()
        weights = (TRUNK_FILE, *(head.file for head in manifest.heads))
        for name in weights:
            log(f"quantizing {name} ({scheme.method})")
            save_tensors(load_file(str(source / name)), staging / name, dtype, scheme)
        for path in source.iterdir():  # the tokenizer, and anything else kept beside
            if path.is_file() and path.name not in (MANIFEST, *weights):
                shutil.copyfile(path, staging / path.name)
        quantized = dataclasses.replace(manifest, quantization=scheme)
        publish(staging, quantized, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    log(f"done: {out} ({directory_bytes(out) / 2**20:.1f} MiB)")
    return quantized
