"""`python -m hydra_jury.orchestrator`: the public Generation service (see
`hydra-jury orchestrator`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from hydra_jury.orchestrator.config import OrchestratorConfig
from hydra_jury.serving.errors import EXPECTED_FAILURES, failure_line


def build_parser(prog: str = "python -m hydra_jury.orchestrator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.description = (
        "Serve hydrajury.v1.Generation: run the speculative PoE loop over a "
        "trunk service and jury shards. Flags override the --config file."
    )
    parser.add_argument("--config", help="YAML file of settings (see orchestrator/config.py)")
    parser.add_argument("--checkpoint", help="the Hydra checkpoint the services serve")
    parser.add_argument(
        "--trunk", help="trunk service address HOST:PORT (kubernetes discovery: its Service)"
    )
    parser.add_argument(
        "--jury", help="comma-separated jury shard addresses (kubernetes discovery: Services)"
    )
    parser.add_argument(
        "--discovery",
        choices=["static", "kubernetes"],
        help="static: the addresses as given (default); kubernetes: follow the ready "
        "endpoints of the named Services (in-cluster), placing each session on replicas",
    )
    parser.add_argument("--namespace", help="kubernetes discovery: default, the pod's own")
    parser.add_argument("--listen", help="address to serve on (default 127.0.0.1:50050)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics HTTP port")
    parser.add_argument("--metrics-address", help="default 127.0.0.1")
    parser.add_argument("--max-concurrency", type=int, help="requests in progress at once")
    parser.add_argument("--connect-timeout-s", type=float)
    parser.add_argument("--grace-s", type=float, help="graceful shutdown time")
    parser.add_argument(
        "--redis-url",
        help="where sessions live: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS "
        "(default $HYDRA_JURY_REDIS_URL)",
    )
    parser.add_argument("--redis-key-prefix", help='prefix of every key (default "hydra-jury:")')
    parser.add_argument("--session-ttl-s", type=float, help="idle sessions expire (default 3600)")
    parser.add_argument(
        "--session-lease-s",
        type=float,
        help="an orchestrator that stops committing loses its sessions after this (default 30)",
    )
    return parser


async def _serve(config: OrchestratorConfig) -> None:
    from hydra_jury.orchestrator.server import serve_orchestrator
    from hydra_jury.orchestrator.sessions.redis_store import RedisStore

    store = RedisStore(
        config.redis_url, prefix=config.redis_key_prefix, settings=config.store_settings()
    )
    running = await serve_orchestrator(
        checkpoint=config.checkpoint,
        discovery=config.make_discovery(),
        store=store,
        address=config.listen,
        metrics_port=config.metrics_port,
        metrics_address=config.metrics_address,
        max_concurrency=config.max_concurrency,
        connect_timeout_s=config.connect_timeout_s,
    )
    await running.serve_until_signal("orchestrator", config.listen, config.grace_s)


def main(argv: list[str] | None = None, prog: str = "python -m hydra_jury.orchestrator") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser(prog).parse_args(argv)
    overrides = {
        k: getattr(args, k)
        for k in (
            "checkpoint",
            "trunk",
            "jury",
            "discovery",
            "namespace",
            "listen",
            "metrics_port",
            "metrics_address",
            "max_concurrency",
            "connect_timeout_s",
            "grace_s",
            "redis_url",
            "redis_key_prefix",
            "session_ttl_s",
            "session_lease_s",
        )
    }
    try:
        config = OrchestratorConfig.load(args.config, overrides)
        asyncio.run(_serve(config))
    except EXPECTED_FAILURES as error:
        print(failure_line("orchestrator", error), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
