"""A whole gRPC stack on loopback for tests: trunk service, jury shards and orchestrator
(the split stack), or the single-process server (`start_embedded`), each a real grpc.aio
server on an ephemeral port, driven by one event loop in a background thread, with its
sessions in a real Redis (under a key prefix of its own). Tests talk to them through
ordinary synchronous channels. With certificates (`tls`) the services are mTLS, the
orchestrator connects to them with its client certificate and serves TLS, and the
tests' channels are TLS too."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.orchestrator.discovery import Discovery, StaticDiscovery
from hydra_jury.orchestrator.server import serve_embedded, serve_orchestrator
from hydra_jury.orchestrator.sessions.redis_store import RedisStore
from hydra_jury.orchestrator.sessions.store import StoreSettings
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from hydra_jury.serving.tls import (
    CertificateDirectory,
    ClientTls,
    ServerTls,
    TlsFlags,
    open_channel,
)
from hydra_jury.serving.worker_service import ServiceOptions, serve_worker
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from hydra_jury.workers.sessions import SessionLimits


class BackgroundLoop:
    """An asyncio event loop running in a daemon thread; `run` waits for a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@dataclass
class Stack:
    checkpoint: str
    shards: list[list[str]]  # heads of each jury shard
    redis_url: str = ""  # where the orchestrator keeps sessions (needed to start one)
    max_sessions: int = 4
    max_session_tokens: int = 128
    reclaim_after_s: float = 0.0  # tests run one request at a time: reclaim at once
    draft_model: str | None = None  # the trunk's draft model (a Hydra checkpoint)
    sessions: StoreSettings = field(default_factory=StoreSettings)
    tls: CertificateDirectory | None = None  # `hydra-jury certs`' files; None: plaintext
    metrics: bool = False  # the trunk and jury replicas serve /metrics on a free port
    device: str = "cpu"  # where every server computes (`tests/gpu`: a CUDA device)
    dtype: str | None = None  # None: the servers' default for the device
    prefix: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:8]}:")
    loop: BackgroundLoop = field(default_factory=BackgroundLoop)
    servers: dict[str, Any] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    channels: list[grpc.Channel] = field(default_factory=list)
    workers: dict[str, Any] = field(default_factory=dict)  # service name -> its stub class
    metrics_ports: dict[str, int] = field(default_factory=dict)  # server name -> /metrics port

    def start_services(self) -> Stack:
        """The trunk service ("trunk") and one service per shard ("jury0", ...)."""
        self.start_replica("trunk")
        for index, heads in enumerate(self.shards):
            self.start_replica(f"jury{index}", heads)
        return self

    @property
    def jury_addresses(self) -> list[str]:
        return [self.addresses[f"jury{i}"] for i in range(len(self.shards))]

    def store(self) -> RedisStore:
        """A client of the stack's sessions (each server gets its own)."""
        return RedisStore(self.redis_url, prefix=self.prefix, settings=self.sessions)

    def load_record(self, session_id: str):
        """The session's record as Redis holds it now (None once it is gone)."""

        async def read():
            store = self.store()
            try:
                return await store.load(session_id)
            finally:
                await store.close()

        return self.loop.run(read())

    def start_replica(self, name: str, heads: list[str] | None = None) -> str:
        """One more trunk replica (`heads` None) or jury replica, named `name`; its port."""
        limits = {
            "max_sessions": self.max_sessions,
            "max_session_tokens": self.max_session_tokens,
            "reclaim_after_s": self.reclaim_after_s,
        }
        spec = TRUNK_SERVICE if heads is None else JURY_SERVICE
        draft_model = self.draft_model if heads is None else None
        options = ServiceOptions(
            self.checkpoint,
            heads=heads,
            draft_model=draft_model,
            dtype=self.dtype,
            device=self.device,
            tls=self.server_tls(),
            metrics_port=0 if self.metrics else None,
            **limits,
        )
        running = self.loop.run(serve_worker(spec, options))
        self.servers[name], self.addresses[name] = running, f"127.0.0.1:{running.port}"
        if running.metrics_port is not None:
            self.metrics_ports[name] = running.metrics_port
        self.workers[name] = (
            internal_pb2_grpc.TrunkStub if heads is None else internal_pb2_grpc.JuryStub
        )
        return running.port

    def start_orchestrator(
        self, name: str = "orchestrator", discovery: Discovery | None = None, **options
    ) -> Stack:
        """An orchestrator over the services (static addresses unless `discovery` is
        given); more than one (other names) share them and the sessions."""
        discovery = discovery or StaticDiscovery(self.addresses["trunk"], self.jury_addresses)
        running = self.loop.run(
            serve_orchestrator(
                checkpoint=self.checkpoint,
                discovery=discovery,
                store=self.store(),
                connect_timeout_s=10,
                tls=self.server_tls(mutual=False),
                internal_tls=self.client_tls(),
                **options,
            )
        )
        self.servers[name] = running
        self.addresses[name] = f"127.0.0.1:{running.port}"
        if running.metrics_port is not None:  # started with metrics_port
            self.metrics_ports[name] = running.metrics_port
        if name == "orchestrator":
            self.servicer, self.metrics_port = running.servicer, running.metrics_port
        return self

    def orchestrator_argv(self) -> list[str]:
        """The flags of an orchestrator process (`python -m hydra_jury.orchestrator`) over
        the stack's services and sessions, listening on an ephemeral port."""
        flags = {
            "--checkpoint": self.checkpoint,
            "--trunk": self.addresses["trunk"],
            "--jury": ",".join(self.jury_addresses),
            "--listen": "127.0.0.1:0",
            "--redis-url": self.redis_url,
            "--redis-key-prefix": self.prefix,
        }
        return [part for flag in flags.items() for part in flag]

    def start_embedded(self, **options) -> Stack:
        """The single-process server in place of services and orchestrator."""
        limits = SessionLimits(
            self.max_sessions, self.max_session_tokens, reclaim_after_s=self.reclaim_after_s
        )
        running = self.loop.run(
            serve_embedded(
                checkpoint=self.checkpoint,
                store=self.store(),
                limits=limits,
                draft_model=self.draft_model,
                dtype=self.dtype,
                device=self.device,
                **options,
            )
        )
        self.servers["orchestrator"] = running
        self.addresses["orchestrator"] = f"127.0.0.1:{running.port}"
        self.servicer, self.metrics_port = running.servicer, running.metrics_port
        return self

    @property
    def embedded(self) -> bool:
        return "orchestrator" in self.servers and not self.workers

    @property
    def holders(self) -> list[str]:
        """Everything that holds session caches, for `active_sessions`."""
        if self.embedded:
            return ["trunk", "jury"]
        return ["trunk", *(f"jury{i}" for i in range(len(self.shards)))]

    def server_tls(self, mutual: bool = True) -> ServerTls | None:
        """A server's TLS over the stack's certificates: mTLS (`mutual`) or TLS."""
        if self.tls is None:
            return None
        ca = self.tls.ca if mutual else None
        return ServerTls.load(self.tls.server_cert, self.tls.server_key, ca)

    def client_tls(self) -> ClientTls | None:
        """A client's TLS with the stack's client certificate (the orchestrator's)."""
        if self.tls is None:
            return None
        return ClientTls.load(
            self.tls.ca, self.tls.client_cert, self.tls.client_key, flags=TlsFlags("--stack-tls")
        )

    def channel(self, name: str) -> grpc.Channel:
        channel = open_channel(self.addresses[name], self.client_tls())
        self.channels.append(channel)
        return channel

    def generation(self, name: str = "orchestrator") -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel(name))

    def active_sessions(self, name: str) -> int:
        """Sessions a worker holds: a trunk or jury service by its name, or in the
        single-process server "trunk" or "jury"."""
        if self.embedded:  # the workers of the in-process backend
            return len(getattr(self.servicer.backend, name).sessions)
        info = self.workers[name](self.channel(name)).Info(internal_pb2.InfoRequest(), timeout=5)
        return info.limits.active_sessions

    def stop_server(self, name: str) -> None:
        """Stops a server at once (a worker service's model thread too)."""
        self.loop.run(self.servers.pop(name).stop(0))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for name in reversed(list(self.servers)):  # the orchestrators first
            self.stop_server(name)
        self.loop.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def retry_busy(call, timeout_s: float = 10.0):
    """`call()`, again while the session is busy (a cancelled generation finishing its
    round)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
