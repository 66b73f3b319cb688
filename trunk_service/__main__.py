"""`python -m trunk_service` (or `hydra-jury trunk`): serve the trunk and drafter heads.

    python -m trunk_service --checkpoint DIR --listen 127.0.0.1:50051 \
        --drafter-heads head0,head1 --max-sessions 16 --max-session-tokens 4096

Prints "trunk service listening on HOST:PORT" to stderr once it serves, runs until
SIGTERM or SIGINT, then stops gracefully and exits 0; exits 2 with a one-line message
when it cannot start (a bad checkpoint, an unknown head, an address in use).
"""

from __future__ import annotations

import argparse
import sys

from protos.worker_servicer import add_service_arguments, head_list, run_until_signal
from trunk_service.server import serve_trunk


def build_parser(prog: str = "python -m trunk_service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a Hydra checkpoint's trunk and drafter heads "
        "(hydrajury.v1.Trunk) to the orchestrator.",
    )
    add_service_arguments(parser, default_port=50051)
    parser.add_argument(
        "--drafter-heads",
        type=head_list,
        metavar="H1,H2",
        help="heads the trunk may draft with (default: every llm head)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m trunk_service") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_until_signal(
        lambda: serve_trunk(
            args.checkpoint,
            address=args.listen,
            drafter_heads=args.drafter_heads,
            max_sessions=args.max_sessions,
            max_session_tokens=args.max_session_tokens,
            idle_timeout_s=args.idle_timeout_s,
            dtype=args.dtype,
            device=args.device,
        ),
        name="trunk service",
        listen=args.listen,
        threads=args.threads,
        grace_s=args.grace_s,
    )


if __name__ == "__main__":
    sys.exit(main())
