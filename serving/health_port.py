"""grpc.health.v1 alone on a plaintext port of its own (`--health-listen`), answering from
a server's health servicer: for probes that cannot do TLS — Kubernetes' native gRPC
probes — at a server whose port is TLS or mTLS. It serves nothing but whether the server
serves (SERVING, or NOT_SERVING once it shuts down), so a plaintext health port gives
no call of the server's away."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from hydra_jury.serving.server import RunningServer, bind, server_options

log = logging.getLogger("hydra_jury")

HEALTH_MESSAGE_LIMIT = 64 * 1024


async def _start(servicer: health.aio.HealthServicer, address: str) -> tuple[grpc.aio.Server, int]:
    # A health check is a few bytes: none of the limit sized for hidden states.
    server = grpc.aio.server(options=server_options(HEALTH_MESSAGE_LIMIT))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        port = bind(server, address)
    except OSError:
        raise OSError(f"--health-listen: cannot bind {address}") from None
    await server.start()
    log.info("grpc.health.v1 in plaintext on %s:%d", address.rsplit(":", 1)[0], port)
    return server, port


@asynccontextmanager
async def health_port(running: RunningServer, address: str | None) -> AsyncIterator[int | None]:
    """While inside, the health of `running` is served in plaintext on `address` too
    (port 0: any free one); yields the port (None: no address, nothing more served). The
    port closes on leaving, after the server's own shutdown. One that cannot bind stops
    the server too: a server is never up without the probes that watch it."""
    if address is None:
        yield None
        return
    try:
        health_server, port = await _start(running.server.health, address)
    except BaseException:
        await running.stop()
        raise
    try:
        yield port
    finally:
        await health_server.stop(0)
