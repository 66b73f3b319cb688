"""The `hydra-jury` command line, above every other package: the model commands
(`model`), the clients (`generate`), the servers (`serve`) and the development
certificates (`certs`)."""

from __future__ import annotations

import argparse
import sys

from hydra_jury.cli import certs, generate, model, serve
from hydra_jury.serving.errors import EXPECTED_FAILURES, failure_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydra-jury",
        description="Serve Hydra language models by speculative Product-of-Experts decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (model, generate, serve, certs):
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in serve.SERVER_COMMANDS:
        return serve.run_server(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except EXPECTED_FAILURES as error:
        print(failure_line(f"hydra-jury {args.command}", error), file=sys.stderr)
        return 2
