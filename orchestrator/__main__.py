"""`python -m hydra_jury.orchestrator`: the public Generation service (see
`hydra-jury orchestrator`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import fields

from hydra_jury.orchestrator.config import DISCOVERY_MODES, OrchestratorConfig
from hydra_jury.orchestrator.flags import add_generation_server_flags, add_internal_tls_flags
from hydra_jury.serving.errors import EXPECTED_FAILURES, failure_line
from hydra_jury.serving.logs import configure_logging
from hydra_jury.serving.model_thread import set_orchestrator_threads
from hydra_jury.serving.tracing import configure_tracing

# Every setting the command line can override: the configuration's fields, one flag each.
SETTINGS = [setting.name for setting in fields(OrchestratorConfig)]


def build_parser(prog: str = "python -m hydra_jury.orchestrator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.description = (
        "Serve hydrajury.v1.Generation: run the speculative PoE loop over a "
        "trunk service and jury shards. Flags override the --config file."
    )
    parser.add_argument("--config", help="YAML file of settings (see orchestrator/config.py)")
    parser.add_argument("--checkpoint", help="the Hydra checkpoint the services serve")
    parser.add_argument(
        "--trunk",
        help="trunk service address HOST:PORT, replicas joined by + (kubernetes discovery: "
        "its Service)",
    )
    parser.add_argument(
        "--jury",
        help="comma-separated jury shard addresses, a shard's replicas joined by + "
        "(kubernetes discovery: Services)",
    )
    parser.add_argument(
        "--discovery",
        choices=DISCOVERY_MODES,
        default=OrchestratorConfig.discovery,
        help="static: the addresses as given; kubernetes: follow the ready endpoints of the "
        "named Services (in-cluster), placing each session on replicas (%(default)s)",
    )
    parser.add_argument("--namespace", help="kubernetes discovery: default, the pod's own")
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=OrchestratorConfig.connect_timeout_s,
        help="how long the services may take to be ready (%(default)g)",
    )
    parser.add_argument(
        "--inject-hop-delay-ms",
        type=float,
        metavar="MS",
        help="for benchmarks: delay every call to a service by this long (half each way), "
        "as if the services ran on other machines (default 0)",
    )
    parser.add_argument(
        "--pipeline-rounds",
        action=argparse.BooleanOptionalAction,
        help="speculative head rounds send the next round's draft to the trunk while the "
        "jury scores (used when every draft token is kept; the tokens never change): "
        "overlaps the hops when the services run on other machines "
        f"(default {'on' if OrchestratorConfig.pipeline_rounds else 'off'})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads of the loop's own maths (default: $OMP_NUM_THREADS, else 1: it is "
        "small, and a team of threads beside the services on one host takes their cores)",
    )
    add_generation_server_flags(parser, redis_fallback="")
    add_internal_tls_flags(parser)
    return parser


async def _serve(config: OrchestratorConfig) -> None:
    from hydra_jury.orchestrator.server import serve_orchestrator
    from hydra_jury.orchestrator.sessions.redis_store import RedisStore
    from hydra_jury.serving.health_port import health_port

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
        hop_delay_s=config.inject_hop_delay_ms / 1000,
        pipeline_rounds=config.pipeline_rounds,
        request_limits=config.request_limits(),
        tls=config.server_tls(),
        internal_tls=config.internal_tls(),
        auth=config.auth(),
        http_listen=config.http_listen,
        served_model_name=config.served_model_name,
    )
    # Once it is up (a server that refuses its layout leaves the process as it was); its
    # rounds' threads set up their torch on their first parallel work, after this.
    set_orchestrator_threads(config.threads)
    async with health_port(running, config.health_listen):
        await running.serve_until_signal("orchestrator", config.listen, config.grace_s)


def main(argv: list[str] | None = None, prog: str = "python -m hydra_jury.orchestrator") -> int:
    # Every setting starts unset, so argparse fills in no default: a flag overrides the
    # --config file only when given.
    unset = argparse.Namespace(**dict.fromkeys(SETTINGS))
    args = build_parser(prog).parse_args(argv, unset)
    try:
        config = OrchestratorConfig.load(args.config, {k: getattr(args, k) for k in SETTINGS})
        configure_logging(config.log_format)
        configure_tracing("hydra-jury-orchestrator", config.otlp_endpoint)
        asyncio.run(_serve(config))
    except EXPECTED_FAILURES as error:
        print(failure_line("orchestrator", error), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
