"""The `hydra-jury` command line."""

from __future__ import annotations

import argparse
import sys

from hydra_model.checkpoint import DTYPES


def _add_build(commands: argparse._SubParsersAction) -> None:
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
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.set_defaults(handler=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from hydra_model.builder import BuildOptions, build_checkpoint

    options = BuildOptions(
        source=args.source,
        out=args.out,
        trunk_layers=args.trunk_layers,
        heads=args.heads,
        head_from=args.head_from,
        lora=args.lora,
        uncertainty_head=args.uncertainty_head,
        dtype=args.dtype,
        force=args.force,
    )
    build_checkpoint(options, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("inspect", help="describe a Hydra checkpoint")
    parser.add_argument("checkpoint", metavar="DIR")
    parser.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from hydra_model.inspect import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydra-jury",
        description="Serve Hydra language models by speculative Product-of-Experts decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_build(commands)
    _add_inspect(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        # Every expected failure (bad checkpoint, bad option, bad source) is a clear line,
        # not a traceback.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"hydra-jury {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
