"""In-process trunk and jury services over the jury checkpoint, for the service tests.

pytest-asyncio is not a dependency, so the servers run on one background event loop (a
thread of its own) and the tests call them through ordinary synchronous channels. Each
test that asks for a service gets a fresh one on 127.0.0.1, port 0 (the tiny model loads
in milliseconds), stopped when the test ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from jury_service.server import JURY_SERVICE
from protos.hydrajury.v1 import internal_pb2_grpc
from serving.worker_service import ServiceOptions, serve_worker
from tests.grpc_stack import BackgroundLoop
from trunk_service.server import TRUNK_SERVICE

SERVICE_LIMITS = {"max_sessions": 2, "max_session_tokens": 32}


@dataclass
class Service:
    """A started service: its port, servicer (for white-box checks) and a client stub."""

    running: Any  # serving.worker_service.RunningService
    port: int
    servicer: Any
    channel: grpc.Channel
    stub: Any

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def background_loop():
    loop = BackgroundLoop()
    yield loop
    loop.close()


def _starter(spec, stub_class, checkpoint, loop: BackgroundLoop):
    started: list[Service] = []

    def start(**options) -> Service:
        options = ServiceOptions(checkpoint, **{**SERVICE_LIMITS, **options})
        running = loop.run(serve_worker(spec, options))
        channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        service = Service(running, running.port, running.servicer, channel, stub_class(channel))
        started.append(service)
        return service

    def stop_all() -> None:
        for service in started:
            service.channel.close()
            loop.run(service.running.stop())

    return start, stop_all


@pytest.fixture
def start_trunk(jury_checkpoint, background_loop) -> Callable[..., Service]:
    """start_trunk(**ServiceOptions fields) → a running trunk service."""
    start, stop_all = _starter(
        TRUNK_SERVICE, internal_pb2_grpc.TrunkStub, jury_checkpoint, background_loop
    )
    yield start
    stop_all()


@pytest.fixture
def start_jury(jury_checkpoint, background_loop) -> Callable[..., Service]:
    """start_jury(**ServiceOptions fields) → a running jury service."""
    start, stop_all = _starter(
        JURY_SERVICE, internal_pb2_grpc.JuryStub, jury_checkpoint, background_loop
    )
    yield start
    stop_all()


@pytest.fixture
def trunk(start_trunk) -> Service:
    return start_trunk()


@pytest.fixture
def jury(start_jury) -> Service:
    return start_jury()
