"""`python -m jury_service` (or `hydra-jury jury`): serve some heads of a checkpoint as
one jury shard.

    python -m jury_service --checkpoint DIR --listen 127.0.0.1:50061 --heads head0,head1

Prints "jury service listening on HOST:PORT (heads head0,head1)" to stderr once it
serves, runs until SIGTERM or SIGINT, then stops gracefully and exits 0; exits 2 with a
one-line message when it cannot start.
"""

from __future__ import annotations

import argparse
import sys

from jury_service.server import serve_jury
from protos.worker_servicer import add_service_arguments, head_list, run_until_signal


def build_parser(prog: str = "python -m jury_service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve some heads of a Hydra checkpoint as a jury shard "
        "(hydrajury.v1.Jury); shards host disjoint head sets.",
    )
    add_service_arguments(parser, default_port=50061)
    parser.add_argument(
        "--heads",
        type=head_list,
        metavar="H1,H2",
        help="heads this shard hosts (default: every llm head)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m jury_service") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_until_signal(
        lambda: serve_jury(
            args.checkpoint,
            address=args.listen,
            heads=args.heads,
            max_sessions=args.max_sessions,
            max_session_tokens=args.max_session_tokens,
            idle_timeout_s=args.idle_timeout_s,
            dtype=args.dtype,
            device=args.device,
        ),
        name="jury service",
        listen=args.listen,
        threads=args.threads,
        grace_s=args.grace_s,
        detail=lambda servicer: f" (heads {','.join(servicer.worker.hosted)})",
    )


if __name__ == "__main__":
    sys.exit(main())
