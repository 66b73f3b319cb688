"""The commands that serve: `serve` (the Generation API from one process), `up` (the split
stack on this host) and the split stack's servers, `trunk`, `jury` and `orchestrator`,
which own their command lines (`main` hands them everything after the name)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

from hydra_jury.cli.certs import make_certificates
from hydra_jury.cli.draft import resolved_draft_model
from hydra_jury.hydra_model.checkpoint import training_summary
from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.orchestrator.__main__ import main as orchestrator_main
from hydra_jury.orchestrator.config import REDIS_URL_VARIABLE
from hydra_jury.orchestrator.flags import (
    add_api_key_flags,
    add_generation_server_flags,
    add_http_listen_flag,
    add_redis_url_flag,
)
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.limits import limits_from
from hydra_jury.orchestrator.server import serve_embedded
from hydra_jury.orchestrator.sessions.redis_server import LocalRedis
from hydra_jury.orchestrator.sessions.redis_store import RedisStore, redacted
from hydra_jury.orchestrator.sessions.store import store_settings_from
from hydra_jury.serving.auth import auth_from
from hydra_jury.serving.flags import (
    add_batching_flags,
    add_draft_model_flag,
    add_log_format_flag,
    add_model_flags,
    add_session_limit_flags,
    add_threads_flag,
    add_tracing_flag,
    batch_limits_from,
)
from hydra_jury.serving.health_port import health_port
from hydra_jury.serving.logs import configure_logging
from hydra_jury.serving.model_thread import set_compute_threads
from hydra_jury.serving.tls import ServerTls
from hydra_jury.serving.tracing import configure_tracing, tracing_endpoint
from hydra_jury.serving.worker_service import service_main
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from hydra_jury.workers.sessions import SessionLimits

SERVER_COMMANDS = {
    "trunk": "serve the trunk and drafter heads (gRPC)",
    "jury": "serve a shard of verifier heads (gRPC)",
    "orchestrator": "serve the public Generation API (gRPC)",
}
WORKER_SERVICES = {"trunk": TRUNK_SERVICE, "jury": JURY_SERVICE}


def add_commands(commands: argparse._SubParsersAction) -> None:
    _add_serve(commands)
    for name, help_text in SERVER_COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    _add_up(commands)


def run_server(name: str, argv: list[str]) -> int:
    prog = f"hydra-jury {name}"
    if name == "orchestrator":
        return orchestrator_main(argv, prog=prog)
    return service_main(WORKER_SERVICES[name], argv, prog, resolve_draft_model=resolved_draft_model)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve the public Generation API from one process (the whole model here)",
        description="Serve hydrajury.v1.Generation (the same API as the orchestrator of the "
        "split stack) over the in-process backend: trunk, every head and the loop in this "
        "process. The default for one machine; `up` runs the split stack.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    add_generation_server_flags(
        parser,
        redis_fallback=", else a private redis-server stopped with the server, its "
        "sessions with it",
    )
    add_session_limit_flags(parser)
    add_model_flags(parser)
    add_threads_flag(parser)
    add_draft_model_flag(parser)
    add_batching_flags(parser)
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    configure_tracing("hydra-jury-server", args.otlp_endpoint)
    # Checked before anything starts: a bad setting is one line, not a half-started server.
    settings = store_settings_from(args)
    set_compute_threads(args.threads)
    limits = SessionLimits(args.max_sessions, args.max_session_tokens)
    draft_model = resolved_draft_model(args.draft_model)
    request_limits = limits_from(args)
    batch_limits = batch_limits_from(args)
    tls = ServerTls.from_settings(args)
    auth = auth_from(args)

    async def serve(store: RedisStore) -> None:
        running = await serve_embedded(
            checkpoint=args.checkpoint,
            store=store,
            address=args.listen,
            limits=limits,
            dtype=args.dtype,
            device=args.device,
            draft_model=draft_model,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address,
            max_concurrency=args.max_concurrency,
            request_limits=request_limits,
            tls=tls,
            auth=auth,
            http_listen=args.http_listen,
            served_model_name=args.served_model_name,
            batch_limits=batch_limits,
        )
        async with health_port(running, args.health_listen):
            served = f"{args.checkpoint} ({training_summary(args.checkpoint)})"
            await running.serve_until_signal(
                "hydra-jury server",
                args.listen,
                args.grace_s,
                f", serving {served}, sessions in {store.where}",
            )

    with contextlib.ExitStack() as stack:
        url = args.redis_url or os.environ.get(REDIS_URL_VARIABLE)
        if not url:
            url = stack.enter_context(LocalRedis()).url
            logging.getLogger("hydra_jury").info(
                "started a private redis-server at %s; its sessions end with this server", url
            )
        store = RedisStore(url, prefix=args.redis_key_prefix, settings=settings)
        asyncio.run(serve(store))
    return 0


def _add_up(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "up",
        help="run the local stack: trunk, jury shards and orchestrator",
        description="Start a trunk service, jury shards splitting the heads and the "
        "orchestrator as separate processes on loopback; Ctrl-C stops them all. They share "
        "the host: the trunk's OpenMP threads spin briefly between parallel regions "
        "(GOMP_SPINCOUNT=30000), the others wait passively (OMP_WAIT_POLICY=PASSIVE), "
        "unless the environment sets either (OMP_WAIT_POLICY=PASSIVE: every process "
        "passive, faster for many concurrent sessions). On one machine `serve` is faster.",
    )
    parser.add_argument(
        "--checkpoint", default="var/models/smollm2-hydra", metavar="DIR", help="(%(default)s)"
    )
    parser.add_argument(
        "--shards", type=int, default=LocalStack.shards, help="jury shards (%(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=LocalStack.port,
        help="orchestrator port; the services use the next ones (%(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="the orchestrator's Prometheus /metrics HTTP port (%(default)s)",
    )
    parser.add_argument(
        "--shard-threads",
        type=int,
        help="CPU threads per jury shard (default: torch's, every core; on a 2-core host one "
        "thread each measured slower)",
    )
    parser.add_argument(
        "--host-turn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the trunk and the shards run their batches in turn, each with every core of "
        "the host they share, rather than at once (default: on)",
    )
    add_http_listen_flag(parser)
    add_redis_url_flag(parser, ", else a private redis-server, stopped with the stack")
    add_draft_model_flag(parser, "on the trunk service: ")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="mTLS between the processes and TLS on the Generation API, with a development "
        "CA and certificates made for this start in a private temporary directory (removed "
        "on stop); the CA's path is printed for clients (--tls-ca)",
    )
    add_api_key_flags(parser)
    add_log_format_flag(parser)
    add_tracing_flag(parser)
    parser.set_defaults(handler=_run_up)


def _api_key_args(args: argparse.Namespace) -> list[str]:
    """The API-key flags `up` was given, for the stack's orchestrator."""
    given = []
    if args.api_keys:
        given += ["--api-keys", str(Path(args.api_keys).resolve())]
    if args.auth_health:
        given.append("--auth-health")
    for flag, value in (
        ("--max-concurrent-per-key", args.max_concurrent_per_key),
        ("--tokens-per-minute-per-key", args.tokens_per_minute_per_key),
    ):
        if value is not None:
            given += [flag, str(value)]
    return given


def _run_up(args: argparse.Namespace) -> int:
    tracing_endpoint(args.otlp_endpoint)  # a bad URL is one line, before any process starts
    with contextlib.ExitStack() as cleanup:
        certificates = None
        if args.tls:
            directory = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="hydra-jury-tls-"))
            certificates = make_certificates(directory)
        stack = LocalStack(
            args.checkpoint,
            shards=args.shards,
            port=args.port,
            metrics_port=args.metrics_port,
            shard_threads=args.shard_threads,
            host_turn=args.host_turn,
            redis_url=args.redis_url or os.environ.get(REDIS_URL_VARIABLE),
            draft_model=resolved_draft_model(args.draft_model),
            tls=certificates,
            http_listen=args.http_listen,
            served_model_name=args.served_model_name,
            orchestrator_args=_api_key_args(args),
            log_format=args.log_format,
            otlp_endpoint=args.otlp_endpoint,
        )
        try:
            address = stack.start()
            print(
                f"hydra-jury stack ready: Generation API at {address}{stack.http_detail}, "
                f"serving {args.checkpoint} "
                f"({training_summary(args.checkpoint)}), sessions in Redis at "
                f"{redacted(stack.sessions_url)}",
                file=sys.stderr,
            )
            if certificates is not None:
                print(
                    f"TLS: connect with --tls-ca {certificates.ca}, e.g. hydra-jury chat "
                    f"--address {address} --tls-ca {certificates.ca}",
                    file=sys.stderr,
                )
            return stack.wait()
        finally:
            stack.stop()
