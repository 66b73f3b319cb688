"""A TCP proxy on loopback that injects network faults between a client and a server,
for `tools.chaos`: it forwards bytes both ways, and on demand delays every chunk, resets
every open connection (RST: SO_LINGER 0, as a peer that vanished) or drops connections
(each new one closed at once, as a partition would end them), until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

CHUNK = 65536


class FaultProxy:
    """Listens on 127.0.0.1 (`address`) and forwards to `target` (HOST:PORT) from an
    event loop in a thread of its own; `close()` stops it."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.delay_s = 0.0
        self.dropping = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    def reset_all(self) -> None:
        """Ends every open connection with an RST."""

        async def reset() -> None:
            for writer in list(self._writers):
                _reset(writer)

        self._run(reset())

    def close(self) -> None:
        self._server.close()
        self.reset_all()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dropping:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:  # the server is down: the client sees its connection end
            writer.close()
            return
        pair = {writer, upstream_writer}
        self._writers |= pair
        try:
            await asyncio.gather(
                self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)
            )
        finally:
            self._writers -= pair
            for end in pair:
                end.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(CHUNK):
                if self.dropping:
                    _reset(writer)
                    return
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(chunk)
                await writer.drain()
        writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with an RST rather than a FIN: linger on, with a zero timeout."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
