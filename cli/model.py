"""The offline model commands: `build`, `train-heads` and `inspect`. Their flags are
named after the fields of the tooling's options (`BuildOptions`, `TrainOptions`), whose
defaults they show."""

from __future__ import annotations

import argparse

from hydra_jury.cli.args import from_flags, log
from hydra_jury.hydra_model.checkpoint import DTYPES


def add_commands(commands: argparse._SubParsersAction) -> None:
    _add_build(commands)
    _add_quantize(commands)
    _add_train_heads(commands)
    _add_inspect(commands)


def _add_quantization_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    from hydra_jury.hydra_model.quantization import ACTIVATIONS, DEFAULT_GROUP_SIZE, METHODS

    parser.add_argument(
        "--quantize",
        choices=METHODS,
        required=required,
        help="quantize the weights: int8 with a scale per output channel, int4 with a "
        "scale and minimum per group of inputs" + ("" if required else " (default: none)"),
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        metavar="N",
        help="int4: inputs per scale and minimum, a multiple of 32 (%(default)s)",
    )
    parser.add_argument(
        "--keep-output-matrix",
        action="store_true",
        help="keep the embedding and LM heads float (default: quantize them too)",
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="int8",
        help="how quantized products take their inputs: int8 quantizes them per block of 32 "
        "and multiplies in integers (fast, as llama.cpp's Q8_0), float keeps them float32 "
        "(%(default)s)",
    )


def _add_build(commands: argparse._SubParsersAction) -> None:
    from hydra_jury.hydra_model.build.builder import BuildOptions

    parser = commands.add_parser(
        "build",
        help="build a Hydra checkpoint from a Hugging Face model or GGUF file",
        description="Split a decoder into a shared trunk and several heads and write a Hydra "
        "checkpoint. Head i takes, in order: the i-th --head-from checkpoint's top "
        "layers, then the next --lora adapter merged into the base top layers, "
        "then plain copies of the base top layers.",
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="SRC",
        help="Hugging Face model directory (safetensors) or a .gguf file",
    )
    parser.add_argument(
        "--trunk-layers",
        type=int,
        required=True,
        metavar="K",
        help="layers 0..K-1 form the shared trunk; the rest are per head",
    )
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="keep only the first N layers of SRC (an early-exit model, e.g. a draft model)",
    )
    parser.add_argument(
        "--heads", type=int, required=True, metavar="N", help="number of heads of role llm"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument(
        "--head-from",
        action="append",
        default=[],
        metavar="DIR",
        help="a full fine-tune of the same architecture (repeatable)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="ADAPTER_DIR",
        help="a PEFT LoRA adapter merged into a head (repeatable)",
    )
    parser.add_argument(
        "--uncertainty-head", action="store_true", help="add one extra head of role uncertainty"
    )
    parser.add_argument(
        "--dtype", default=BuildOptions.dtype, choices=list(DTYPES), help="(%(default)s)"
    )
    _add_quantization_flags(parser, required=False)
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.set_defaults(handler=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.builder import BuildOptions, build_checkpoint

    build_checkpoint(from_flags(BuildOptions, args), log=log)
    return 0


def _add_quantize(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quantize",
        help="write a quantized copy of a Hydra checkpoint",
        description="Quantize every projection of the trunk and the heads (and, unless "
        "--keep-output-matrix, the embedding and LM heads) of a float checkpoint. "
        "Every service, serve and generate --local load the result unchanged; decoding "
        "is exact with respect to the quantized model's own distributions.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="float checkpoint")
    parser.add_argument("--out", required=True, metavar="DIR", help="the quantized checkpoint")
    _add_quantization_flags(parser, required=True)
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.set_defaults(handler=_run_quantize)


def _run_quantize(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.quantize import quantize_checkpoint
    from hydra_jury.hydra_model.quantization import QuantizationScheme

    scheme = QuantizationScheme.from_flags(
        args.quantize, args.group_size, args.keep_output_matrix, args.activations
    )
    quantize_checkpoint(args.checkpoint, args.out, scheme, force=args.force, log=log)
    return 0


def _add_train_heads(commands: argparse._SubParsersAction) -> None:
    from hydra_jury.hydra_model.build.corpus import CORPUS_FORMAT
    from hydra_jury.hydra_model.build.train import DEFAULT_LEARNING_RATE, TrainOptions

    parser = commands.add_parser(
        "train-heads",
        help="fine-tune each head on its own shard of a corpus",
        description="Fine-tune each llm head of a Hydra checkpoint on its own shard of a "
        "JSON-lines corpus (head i of n trains on texts i, i+n, ...), the trunk frozen "
        "and its hidden states computed once. Writes a new checkpoint; run the same "
        "command again to resume an interrupted run from its last saved step.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    parser.add_argument(
        "--data",
        default="",
        metavar="FILE",
        help=f"corpus: {CORPUS_FORMAT} (not with --uncertainty)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the trained checkpoint")
    parser.add_argument(
        "--lora",
        dest="lora_rank",
        type=int,
        metavar="RANK",
        help="train LoRA adapters of this rank (merged on save) instead of every weight",
    )
    parser.add_argument(
        "--steps", type=int, default=TrainOptions.steps, metavar="N", help="(%(default)s)"
    )
    parser.add_argument(
        "--lr",
        dest="learning_rate",
        type=float,
        metavar="RATE",
        help=f"AdamW learning rate (default {DEFAULT_LEARNING_RATE['full']:g}, "
        f"with --lora {DEFAULT_LEARNING_RATE['lora']:g})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=TrainOptions.batch_size,
        metavar="N",
        help="windows per head and step (%(default)s)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=TrainOptions.seq_len,
        metavar="N",
        help="tokens per window (%(default)s)",
    )
    parser.add_argument("--seed", type=int, default=TrainOptions.seed, help="(%(default)s)")
    parser.add_argument(
        "--save-every",
        type=int,
        default=TrainOptions.save_every,
        metavar="N",
        help="save the run's state every N steps (resumable; %(default)s)",
    )
    parser.add_argument(
        "--force", action="store_true", help="discard an existing --out (or unfinished run)"
    )
    parser.add_argument(
        "--replace-stale",
        action="store_true",
        help="resume an unfinished run of these settings at --out, else start over "
        "(where --out is refused without --force)",
    )
    parser.add_argument(
        "--uncertainty",
        action="store_true",
        help="train the uncertainty head instead, on multiple-choice questions the "
        "project writes and the model answers; reports calibration on a held-out quarter",
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=TrainOptions.questions,
        metavar="N",
        help="with --uncertainty: questions to write, answer and grade (%(default)s)",
    )
    parser.set_defaults(handler=_run_train_heads)


def _run_train_heads(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.train import ProgressBar, TrainOptions, train_heads
    from hydra_jury.hydra_model.build.train_uncertainty import train_uncertainty

    if args.uncertainty == bool(args.data):
        raise ValueError("give --data (train the llm heads) or --uncertainty, not both")
    options = from_flags(TrainOptions, args)
    if args.uncertainty:
        judged = train_uncertainty(options, log=log, on_step=ProgressBar())
        print(
            f"held out ({judged.questions} questions, a quarter held out; the model answered "
            f"{judged.correct_rate:.1%} correctly):"
        )
        print(f"  untrained head: {judged.before.line()}")
        print(f"  trained head:   {judged.after.line()}")
        print(f"  constant rate:  Brier {judged.constant_brier:.4f}")
        return 0
    result = train_heads(options, log=log, on_step=ProgressBar())
    first, last = result.losses[0], result.losses[-1]
    for name, before, after in zip(result.heads, first, last, strict=True):
        print(f"{name}: loss {before:.3f} at step 1, {after:.3f} at step {len(result.losses)}")
    return 0


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("inspect", help="describe a Hydra checkpoint")
    parser.add_argument("checkpoint", metavar="DIR")
    parser.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.describe import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0
