"""Starting a worker service (trunk or jury): options, checkpoint loading, the server, and
the command line both services share (`hydra-jury trunk`, `hydra-jury jury`).

A service is described once by a `WorkerServiceSpec` (its name, default port, which
heads its `--heads` option names, whether it loads the trunk, how to build its servicer);
`serve_worker` starts any of them and `service_main` is their whole command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.checkpoint import read_manifest
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.errors import EXPECTED_FAILURES, failure_line
from hydra_jury.serving.flags import (
    DEVICE,
    METRICS_ADDRESS,
    add_batching_flags,
    add_draft_model_flag,
    add_grace_flag,
    add_listen_flag,
    add_log_format_flag,
    add_metrics_flags,
    add_model_flags,
    add_session_limit_flags,
    add_threads_flag,
    add_tls_flags,
    add_tracing_flag,
    batch_limits_from,
)
from hydra_jury.serving.health_port import health_port
from hydra_jury.serving.host_turn import HostTurn
from hydra_jury.serving.logs import configure_logging
from hydra_jury.serving.metrics import serve_metrics
from hydra_jury.serving.model_thread import ModelThread, set_compute_threads, start_model_thread
from hydra_jury.serving.server import GrpcServer, RunningServer
from hydra_jury.serving.servicer import WorkerServicer
from hydra_jury.serving.tls import ServerTls, transport
from hydra_jury.serving.tracing import configure_tracing
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import SessionLimits

log = logging.getLogger("hydra_jury.service")
# --idle-timeout-s: a served session idle this long is evicted. `ServiceOptions` keeps
# its None (never) for the services a test or a program starts itself.
IDLE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServiceOptions:
    """What a worker service is started with (the flags of `service_main`)."""

    checkpoint: str | Path
    listen: str = "127.0.0.1:0"  # port 0 picks a free one
    heads: Sequence[str] | None = None  # None: every `llm` head
    max_sessions: int = SessionLimits.max_sessions
    max_session_tokens: int = SessionLimits.max_session_tokens
    idle_timeout_s: float | None = None  # None or 0: never evicted
    reclaim_after_s: float = SessionLimits.reclaim_after_s
    dtype: str | None = None  # None: the checkpoint's
    device: str = DEVICE
    draft_model: str | Path | None = None  # the trunk's draft model (a Hydra checkpoint)
    # continuous batching's admission control
    batch_limits: BatchLimits = field(default_factory=BatchLimits)
    metrics_port: int | None = None  # None: no metrics served; 0 picks a free port
    metrics_address: str = METRICS_ADDRESS
    tls: ServerTls | None = None  # None: plaintext
    # The lock file of the services sharing this host's cores (`serving.host_turn`);
    # None: the service has its cores to itself.
    host_turn: str | Path | None = None

    @property
    def limits(self) -> SessionLimits:
        return SessionLimits(
            self.max_sessions, self.max_session_tokens, self.idle_timeout_s, self.reclaim_after_s
        )


@dataclass(frozen=True)
class WorkerServiceSpec:
    name: str  # "trunk service"
    service_name: str  # the gRPC service's full name, for health and reflection
    default_port: int
    description: str  # of the command line
    heads_option: str  # the flag naming its heads
    heads_help: str
    load_trunk: bool
    # (model with the chosen heads, the heads, options, model thread) → the servicer
    build_servicer: Callable[[HydraModel, list[str], ServiceOptions, ModelThread], WorkerServicer]
    add_servicer: Callable[[Any, grpc.aio.Server], None]
    hosts_draft_model: bool = False  # takes --draft-model
    # Holds the host turn beside the other services of its kind (the jury shards, which
    # score the same positions at once), not alone.
    shares_host_turn: bool = False


def llm_heads_in_order(checkpoint: str | Path, names: Sequence[str] | None, option: str):
    """`names` (None: every `llm` head) checked against the checkpoint and put in its
    order, so the order of a command-line list never changes what a service does."""
    llm = [head.name for head in read_manifest(checkpoint).llm_heads]
    if names is None:
        return llm
    unknown = [name for name in names if name not in llm]
    if unknown:
        raise InvalidArgument(
            f"{option}: {unknown} are not llm heads of {checkpoint}; it has {llm}"
        )
    if not names:
        raise InvalidArgument(f"{option}: at least one head is required")
    return [name for name in llm if name in names]


async def serve_worker(spec: WorkerServiceSpec, options: ServiceOptions) -> RunningServer:
    """Loads the service's heads (and the trunk if it needs one) and starts it on
    `options.listen`. Stop it with `RunningServer.stop`."""
    limits = options.limits
    heads = llm_heads_in_order(options.checkpoint, options.heads, spec.heads_option)

    def build(thread: ModelThread) -> WorkerServicer:
        if options.host_turn is not None:
            thread.host_turn = HostTurn(options.host_turn, shared=spec.shares_host_turn)
        model = HydraModel.load(
            options.checkpoint,
            dtype=options.dtype,
            device=options.device,
            heads=heads,
            load_trunk=spec.load_trunk,
        )
        return spec.build_servicer(model, heads, options, thread)

    # Loaded and built on the model thread: one OpenMP team (see serving.model_thread).
    servicer = await start_model_thread(spec.name.split()[0] + "-model", build)
    server = GrpcServer(
        lambda grpc_server: spec.add_servicer(servicer, grpc_server),
        [spec.service_name],
        on_error=servicer.count_refusal,
        credentials=options.tls.credentials() if options.tls else None,
    )
    metrics_port = None
    try:
        if options.metrics_port is not None:
            metrics_port = serve_metrics(
                servicer.metrics.registry, options.metrics_port, options.metrics_address
            )
        port = await server.start(options.listen)
    except BaseException:
        await servicer.close()
        raise
    servicer.start_idle_eviction()
    log.info(
        "%s: %s, heads %s, %d sessions of %d tokens, port %d (%s)%s",
        spec.name,
        options.checkpoint,
        ",".join(heads),
        limits.max_sessions,
        servicer.worker.max_session_tokens,
        port,
        transport(options.tls),
        f", draft model {options.draft_model}" if options.draft_model else "",
    )
    return RunningServer(server, port, servicer, metrics_port)


def head_list(text: str) -> list[str]:
    """'head0, head1' → ['head0', 'head1'] (for comma-separated head options)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser(spec: WorkerServiceSpec, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=spec.description)
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    add_listen_flag(parser, f"127.0.0.1:{spec.default_port}")
    parser.add_argument(
        spec.heads_option, dest="heads", type=head_list, metavar="H1,H2", help=spec.heads_help
    )
    add_session_limit_flags(parser)
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="evict sessions idle this long (0 = never; %(default)g)",
    )
    parser.add_argument(
        "--reclaim-after-s",
        type=float,
        default=ServiceOptions.reclaim_after_s,
        help="when full, a new session takes the slot of the least recently used "
        "finished one at once, else of a running one idle this long (its orchestrator "
        "re-prefills from the session record if it comes back; %(default)g)",
    )
    if spec.hosts_draft_model:
        add_draft_model_flag(parser)
    add_model_flags(parser)
    add_threads_flag(parser)
    add_batching_flags(parser)
    parser.add_argument(
        "--host-turn",
        metavar="FILE",
        help="a lock file named by every service of this host that shares its cores (the "
        "local stack): their batches take turns, each with every core, instead of "
        "running at once (default: none, the service has its cores to itself)",
    )
    add_metrics_flags(parser)
    add_grace_flag(parser)
    add_tls_flags(parser)
    add_log_format_flag(parser)
    add_tracing_flag(parser)
    return parser


def service_main(
    spec: WorkerServiceSpec,
    argv: list[str] | None = None,
    prog: str = "",
    resolve_draft_model: Callable[[str | None], str | None] = lambda path: path,
) -> int:
    """The whole command line of a worker service. Prints "NAME listening on
    HOST:PORT[ DETAIL]" to stderr once it serves (the line launchers wait for), serves
    until SIGTERM or SIGINT, then stops gracefully and returns 0; returns 2 with a
    one-line message when it cannot start (a bad checkpoint, an unknown head, an
    address in use, a TLS file missing or not matching its pair). `resolve_draft_model`
    turns the parsed --draft-model into the Hydra checkpoint the service loads (the CLI
    converts other formats)."""
    args = build_parser(spec, prog or f"hydra-jury {spec.name.split()[0]}").parse_args(argv)
    configure_logging(args.log_format)

    async def serve() -> int:
        try:
            role = spec.name.split()[0]  # "trunk", "jury"
            heads = {"hydra.heads": ",".join(args.heads)} if args.heads else {}
            configure_tracing(f"hydra-jury-{role}", args.otlp_endpoint, heads)
            set_compute_threads(args.threads)
            options = ServiceOptions(
                checkpoint=args.checkpoint,
                listen=args.listen,
                heads=args.heads,
                max_sessions=args.max_sessions,
                max_session_tokens=args.max_session_tokens,
                idle_timeout_s=args.idle_timeout_s,
                reclaim_after_s=args.reclaim_after_s,
                dtype=args.dtype,
                device=args.device,
                draft_model=resolve_draft_model(getattr(args, "draft_model", None)),
                batch_limits=batch_limits_from(args),
                metrics_port=args.metrics_port,
                metrics_address=args.metrics_address,
                tls=ServerTls.from_settings(args),
                host_turn=args.host_turn,
            )
            running = await serve_worker(spec, options)
            detail = running.servicer.listening_detail()
            async with health_port(running, args.health_listen):
                await running.serve_until_signal(spec.name, args.listen, args.grace_s, detail)
        except EXPECTED_FAILURES as error:
            print(failure_line(spec.name, error), file=sys.stderr, flush=True)
            return 2
        return 0

    return asyncio.run(serve())
