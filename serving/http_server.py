"""An ASGI application served over HTTP by uvicorn on the running event loop, beside a
gRPC server of the same process (the Generation servers' OpenAI-compatible API).

uvicorn runs here piecewise — bind, `startup`, its tick loop, `shutdown` — rather than
through `Server.serve`: that one takes over SIGINT and SIGTERM (the process's graceful
drain owns them) and exits the process when it cannot bind (a bind failure must be an
error naming the flag, the gRPC server stopped with it). The socket is bound here, so
port 0 picks a free port and the port is known before the first request. With the
server's TLS (`ServerTls`) the port is HTTPS: the same certificate and, with a client CA,
the same client certificates required as on the gRPC port."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from hydra_jury.serving.tls import ServerTls, transport

log = logging.getLogger("hydra_jury")


def _bind(address: str, flag: str) -> socket.socket:
    """A listening socket on HOST:PORT ([V6]:PORT for IPv6; port 0: any free one)."""
    host, separator, port = address.rpartition(":")
    host = host.strip("[]")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"{flag}: expected HOST:PORT, got {address!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, int(port)), family=family)
    except OSError as error:
        raise OSError(f"{flag}: cannot bind {address}: {error.strerror or error}") from None


class HttpServer:
    """`app` served on one address until `stop`; `address` is HOST:PORT once started."""

    def __init__(self, app, *, tls: ServerTls | None = None, flag: str = "--http-listen") -> None:
        """`flag` names the setting of the address, for the messages."""
        self.tls, self.flag = tls, flag
        self.config = uvicorn.Config(
            app,
            http="h11",
            ws="none",
            lifespan="off",
            interface="asgi3",
            # The process's logging stays as it is; requests are counted by the metrics.
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            ssl_context_factory=(lambda _config, _default: tls.ssl_context()) if tls else None,
        )
        self.server = uvicorn.Server(self.config)
        self.socket: socket.socket | None = None
        self.address = ""
        self._ticking: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1] if self.socket else 0

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    async def start(self, address: str) -> int:
        """Binds `address` and serves; returns the port. OSError when it cannot bind."""
        self.config.load()
        # What Server.serve sets before its startup: the lifespan protocol ("off": none).
        self.server.lifespan = self.config.lifespan_class(self.config)
        self.socket = _bind(address, self.flag)
        await self.server.startup(sockets=[self.socket])
        self._ticking = asyncio.get_running_loop().create_task(self.server.main_loop())
        self.address = f"{address.rpartition(':')[0]}:{self.port}"
        log.info("HTTP API (%s) on %s://%s", transport(self.tls), self.scheme, self.address)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, lets responses in flight finish for
        `grace_s`, then cancels them."""
        if self._ticking is None:
            return
        self.server.should_exit = True
        await self._ticking
        self._ticking = None
        self.config.timeout_graceful_shutdown = grace_s
        await self.server.shutdown(sockets=[self.socket])
