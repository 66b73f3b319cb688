"""The command-line flags the servers share (the worker services, the orchestrator,
`hydra-jury serve`, and `generate --local` for the model's), each defined once here;
and the TLS flags of a client (the orchestrator's towards the services, the client
commands' towards a server), named by `serving.tls.TlsFlags`.

A flag whose setting a dataclass owns takes its default from it (`SessionLimits`); the
rest are named here and read by the servers' own option classes (`ServiceOptions`, the
orchestrator's configuration), so that a flag and the option it sets never disagree.
Help strings show the defaults argparse holds (`%(default)s`)."""

from __future__ import annotations

import argparse

from hydra_jury.hydra_model.checkpoint import DTYPES
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.logs import LOG_FORMATS
from hydra_jury.serving.tls import SERVER_FLAGS, TlsFlags
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import SessionLimits

DEVICE = "cpu"
GRACE_S = 5.0  # on SIGTERM/SIGINT, how long in-flight calls may finish
METRICS_ADDRESS = "127.0.0.1"


def add_listen_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--listen",
        default=default,
        metavar="HOST:PORT",
        help="address to serve on (port 0 picks a free one; default %(default)s)",
    )


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics on this HTTP port"
    )
    parser.add_argument("--metrics-address", default=METRICS_ADDRESS, help="(%(default)s)")


def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LOG_FORMATS[0],
        help="text: readable lines; json: one JSON object a line, for log pipelines; the "
        "Generation API logs a line per finished or failed generation (%(default)s)",
    )


def add_tracing_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export OpenTelemetry traces over OTLP/gRPC to this collector, http://HOST:PORT "
        "or https://HOST:PORT (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
        "$OTEL_EXPORTER_OTLP_ENDPOINT, else off; the other OTEL_* variables, such as "
        "OTEL_TRACES_SAMPLER, apply)",
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """How the checkpoint is loaded."""
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="default: bfloat16 on CUDA, else the checkpoint's",
    )
    parser.add_argument("--device", default=DEVICE, help="cpu, cuda, cuda:1, ... (%(default)s)")


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for model compute (default: torch's; on a host shared by several "
        "services, give each its share of the cores)",
    )


def add_grace_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grace-s",
        type=float,
        default=GRACE_S,
        help="on SIGTERM/SIGINT, let in-flight calls finish this long (%(default)g)",
    )


def add_session_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=SessionLimits.max_sessions,
        help="sessions held at once (%(default)s)",
    )
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=SessionLimits.max_session_tokens,
        help="positions one session may reach, at most the model's context length (%(default)s)",
    )


def add_batching_flags(parser: argparse.ArgumentParser) -> None:
    """Continuous batching and its admission control (`serving.batcher.BatchLimits`):
    the worker services' and the single-process server's."""
    defaults = BatchLimits()
    group = parser.add_argument_group(
        "batching", "concurrent calls of different sessions run as one forward"
    )
    group.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_tokens,
        help="positions one batched forward of concurrent calls may run (%(default)s)",
    )
    group.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        help="calls waiting for the model; more are refused with RESOURCE_EXHAUSTED (%(default)s)",
    )
    group.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=defaults.max_wait_s,
        help="a call waiting longer is refused with RESOURCE_EXHAUSTED (%(default)g)",
    )
    group.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=defaults.prefill_chunk,
        help="run a longer prefill in chunks of this many positions, so that other "
        "sessions' steps run between them (0: whole; %(default)s)",
    )
    group.add_argument(
        "--batch-window-ms",
        type=float,
        default=1000 * defaults.window_s,
        help="a batch smaller than the recent ones waits up to this long for more calls "
        "while the model has nothing else to run (0: never; %(default)g)",
    )


def batch_limits_from(args: argparse.Namespace) -> BatchLimits:
    """The batching flags (`add_batching_flags`), checked."""
    if args.max_batch_tokens < 1 or args.max_queue < 1 or not args.max_queue_wait_s > 0:
        raise InvalidArgument(
            "--max-batch-tokens and --max-queue must be at least 1 and --max-queue-wait-s "
            f"positive; got {args.max_batch_tokens}, {args.max_queue}, {args.max_queue_wait_s}"
        )
    if args.prefill_chunk_tokens < 0:
        raise InvalidArgument(
            f"--prefill-chunk-tokens must be at least 0 (0: whole), got {args.prefill_chunk_tokens}"
        )
    if not 0 <= args.batch_window_ms <= 1000:
        raise InvalidArgument(f"--batch-window-ms must be in 0..1000, got {args.batch_window_ms}")
    return BatchLimits(
        args.max_batch_tokens,
        args.max_queue,
        args.max_queue_wait_s,
        args.prefill_chunk_tokens,
        args.batch_window_ms / 1000,
    )


def add_draft_model_flag(parser: argparse.ArgumentParser, where: str = "") -> None:
    """--draft-model; `where` says which process loads it, where that is not plain."""
    parser.add_argument(
        "--draft-model",
        metavar="PATH",
        help=f"{where}a small causal LM with the checkpoint's tokenizer, for drafter 'model': "
        "a Hydra checkpoint (its trunk and first head form the LM); `hydra-jury` also takes "
        "a Hugging Face model directory or a .gguf file, converted once into "
        "$HYDRA_JURY_CACHE or ~/.cache/hydra-jury",
    )


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The server's TLS (`serving.tls.ServerTls`) and the plaintext health port its
    probes may need."""
    flags = SERVER_FLAGS
    group = parser.add_argument_group(
        "TLS", f"with {flags.cert} and {flags.key} the port is TLS; with {flags.ca} as well, mTLS"
    )
    group.add_argument(flags.cert, metavar="FILE", help="the server's certificate chain (PEM)")
    group.add_argument(flags.key, metavar="FILE", help="its private key (PEM, unencrypted)")
    group.add_argument(
        flags.ca,
        metavar="FILE",
        help="require a client certificate signed by this CA (PEM) from every client",
    )
    group.add_argument(
        "--health-listen",
        metavar="HOST:PORT",
        help="serve grpc.health.v1 alone, in plaintext, on this address too: for probes "
        "that cannot do TLS, such as Kubernetes' gRPC probes",
    )


def add_client_tls_flags(
    parser: argparse.ArgumentParser, flags: TlsFlags, title: str, description: str, servers: str
) -> None:
    """A client's TLS flags (`serving.tls.ClientTls.from_settings` reads them); `servers`
    names what it connects to ("the services")."""
    group = parser.add_argument_group(title, description)
    group.add_argument(
        flags.ca, metavar="FILE", help=f"the CA (PEM) that signed the certificates of {servers}"
    )
    group.add_argument(
        flags.cert,
        metavar="FILE",
        help=f"a client certificate (PEM), for {servers} requiring one (mTLS)",
    )
    group.add_argument(flags.key, metavar="FILE", help="its private key (PEM)")
    group.add_argument(
        flags.server_name,
        metavar="NAME",
        help=f"the name the certificates of {servers} must carry, instead of the host of "
        "the address",
    )
