"""The flags of the public Generation API's two servers, `hydra-jury orchestrator` (the
split stack's) and `hydra-jury serve` (one process), defined once with the defaults of
`OrchestratorConfig`; --redis-url is `hydra-jury up`'s too."""

from __future__ import annotations

import argparse
from dataclasses import fields

from hydra_jury.orchestrator.config import (
    INTERNAL_TLS_FLAGS,
    REDIS_URL_VARIABLE,
    OrchestratorConfig,
)
from hydra_jury.orchestrator.limits import RequestLimits, limit_flag
from hydra_jury.serving.flags import (
    add_client_tls_flags,
    add_grace_flag,
    add_listen_flag,
    add_log_format_flag,
    add_metrics_flags,
    add_tls_flags,
    add_tracing_flag,
)


def add_generation_server_flags(parser: argparse.ArgumentParser, redis_fallback: str) -> None:
    """`redis_fallback`: where sessions live when neither --redis-url nor the variable
    names a Redis (", else ...", or "" where one is required)."""
    add_listen_flag(parser, OrchestratorConfig.listen)
    add_http_listen_flag(parser)
    add_metrics_flags(parser)
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=OrchestratorConfig.max_concurrency,
        help="generations in progress at once; more are refused with RESOURCE_EXHAUSTED "
        "(%(default)s)",
    )
    add_grace_flag(parser)
    add_request_limit_flags(parser)
    add_redis_url_flag(parser, redis_fallback)
    parser.add_argument(
        "--redis-key-prefix",
        default=OrchestratorConfig.redis_key_prefix,
        help="prefix of every key (%(default)s)",
    )
    parser.add_argument(
        "--session-ttl-s",
        type=float,
        default=OrchestratorConfig.session_ttl_s,
        help="idle sessions expire after this long (%(default)g)",
    )
    parser.add_argument(
        "--session-lease-s",
        type=float,
        default=OrchestratorConfig.session_lease_s,
        help="a generation that stops committing loses its session after this (%(default)g)",
    )
    parser.add_argument(
        "--session-commit-interval-s",
        type=float,
        default=OrchestratorConfig.session_commit_interval_s,
        help="a generation's rounds computed within this long of its last commit go with "
        "its next one, together: fewer commits when rounds are fast (0: each round once "
        "the last commit is done; %(default)g)",
    )
    add_tls_flags(parser)
    add_api_key_flags(parser)
    add_log_format_flag(parser)
    add_tracing_flag(parser)


def add_http_listen_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--http-listen",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API (docs/http-api.md) on this address, "
        "HTTPS with the --tls-* files (port 0 picks a free one; default: off)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name the HTTP API serves and requests give (default: the "
        "checkpoint folder's name)",
    )


def add_redis_url_flag(parser: argparse.ArgumentParser, fallback: str) -> None:
    parser.add_argument(
        "--redis-url",
        help="where sessions live: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS "
        f"(default ${REDIS_URL_VARIABLE}{fallback})",
    )


def add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """--limit-NAME for each field NAME of `RequestLimits`, its meaning and default
    read from the field."""
    group = parser.add_argument_group(
        "request limits",
        "hard limits on one request; a request past one is refused with a detail naming the flag",
    )
    for limit in fields(RequestLimits):
        group.add_argument(
            limit_flag(limit.name),
            type=type(limit.default),
            default=limit.default,
            metavar="N",
            help=f"{limit.metadata['help']} (%(default)s)",
        )


def add_internal_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The orchestrator's side of the hops to the trunk and the shards."""
    flags = INTERNAL_TLS_FLAGS
    add_client_tls_flags(
        parser,
        flags,
        "internal TLS",
        f"with {flags.ca} every channel to the services is TLS (never plaintext); with "
        f"{flags.cert} and {flags.key} as well, mTLS; kubernetes discovery connects to pod "
        f"IPs, which no certificate names: give {flags.server_name}",
        "the services",
    )


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    """Client authentication on the Generation API (`serving.auth`)."""
    group = parser.add_argument_group(
        "API keys",
        "with --api-keys every call needs 'authorization: Bearer KEY' metadata; "
        "sessions belong to the key that made them",
    )
    group.add_argument(
        "--api-keys",
        metavar="FILE",
        help="the key file: one NAME:KEY or NAME:sha256:HEX a line, each optionally "
        "followed by :max_concurrent=N,tokens_per_minute=N; reloaded on SIGHUP and when it "
        "changes (default: none, the API is open to any client)",
    )
    group.add_argument(
        "--auth-health",
        action="store_true",
        default=OrchestratorConfig.auth_health,
        help="require a key for health checks and reflection too (Kubernetes' gRPC probes "
        "cannot send one)",
    )
    group.add_argument(
        "--max-concurrent-per-key",
        type=int,
        metavar="N",
        help="generations in progress at once per key, for keys whose line sets none "
        "(default, or 0: no limit)",
    )
    group.add_argument(
        "--tokens-per-minute-per-key",
        type=int,
        metavar="N",
        help="generated tokens per key in any 60 s, for keys whose line sets none (default, "
        "or 0: no limit)",
    )
