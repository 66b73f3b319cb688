"""Worker services for tests: fixtures that start real trunk and jury services on
127.0.0.1 (port 0) over the jury checkpoint, and request builders. Registered as a
plugin by `tests/conftest.py`.

pytest-asyncio is not a dependency, so the servers run on one background event loop (a
thread of its own) and the tests call them through ordinary synchronous channels. Each
test that asks for a service gets a fresh one (the tiny model loads in milliseconds),
stopped when the test ends.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.poe import SamplingParams
from hydra_jury.protos.codec import tensor_from_pb, tensor_to_pb
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc, tensor_pb2
from hydra_jury.serving.internal_wire import sampling_to_pb
from hydra_jury.serving.worker_service import ServiceOptions, serve_worker
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from tests.grpc_stack import BackgroundLoop

Code = grpc.StatusCode
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
PROMPT = [5, 6, 7, 9, 10]
PROMPT_LENGTH = len(PROMPT)
HIDDEN_SIZE = 64


def prefill_request(session="s", start=0, tokens=PROMPT) -> internal_pb2.TrunkPrefillRequest:
    return internal_pb2.TrunkPrefillRequest(session=session, start=start, tokens=tokens)


def draft_request(
    session="s", start=PROMPT_LENGTH, pending=11, gamma=4, draft_head="head0", **fields
) -> internal_pb2.DraftRequest:
    fields.setdefault("sampling", sampling_to_pb(GREEDY))
    return internal_pb2.DraftRequest(
        session=session,
        start=start,
        pending_token=pending,
        gamma=gamma,
        draft_head=draft_head,
        **fields,
    )


def jury_prefill_request(session="s", start=0, positions=3) -> internal_pb2.JuryPrefillRequest:
    return internal_pb2.JuryPrefillRequest(
        session=session, start=start, hidden=tensor_to_pb(torch.zeros(positions, HIDDEN_SIZE))
    )


def score_request(session="s", start=0, hidden=None, **fields) -> internal_pb2.ScoreRequest:
    fields = {"jury": ["head0", "head1"], "temperature": 1.0, "beta": 1.0, **fields}
    if hidden is None:
        hidden = tensor_to_pb(torch.zeros(2, HIDDEN_SIZE))
    return internal_pb2.ScoreRequest(session=session, start=start, hidden=hidden, **fields)


def decoded(message: tensor_pb2.Tensor) -> torch.Tensor:
    return tensor_from_pb(
        message, name="t", dtypes=[message.dtype], shape=[None] * len(message.shape)
    )


def assert_error(method, request, code: grpc.StatusCode, message: str) -> None:
    """`method(request)` fails with `code` and details matching `message`."""
    with pytest.raises(grpc.RpcError) as caught:
        method(request, timeout=10)
    error = caught.value
    assert error.code() == code, error.details()
    assert re.search(message, error.details()), error.details()


def assert_refused(service: Service, method: str, request, code, message: str) -> None:
    """`service` refuses `request` with `code` and a detail matching `message`, and the
    refused request leaves no session behind."""
    assert_error(getattr(service.stub, method), request, code, message)
    assert service.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions == 0


SERVICE_LIMITS = {"max_sessions": 2, "max_session_tokens": 32}


@dataclass
class Service:
    """A started service: its port, servicer (for white-box checks) and a client stub."""

    running: Any  # serving.server.RunningServer
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


def _services(
    spec, stub_class, checkpoint, loop: BackgroundLoop
) -> Iterator[Callable[..., Service]]:
    """A fixture's body: yields `start(**ServiceOptions fields)`, which starts one more
    service of `spec`, and stops every service it started once the test is over."""
    started: list[Service] = []

    def start(**options) -> Service:
        options = ServiceOptions(checkpoint, **{**SERVICE_LIMITS, **options})
        running = loop.run(serve_worker(spec, options))
        channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        service = Service(running, running.port, running.servicer, channel, stub_class(channel))
        started.append(service)
        return service

    yield start
    for service in started:
        service.channel.close()
        loop.run(service.running.stop())


@pytest.fixture
def start_trunk(jury_checkpoint, background_loop) -> Callable[..., Service]:
    """start_trunk(**ServiceOptions fields) → a running trunk service."""
    yield from _services(
        TRUNK_SERVICE, internal_pb2_grpc.TrunkStub, jury_checkpoint, background_loop
    )


@pytest.fixture
def start_jury(jury_checkpoint, background_loop) -> Callable[..., Service]:
    """start_jury(**ServiceOptions fields) → a running jury service."""
    yield from _services(JURY_SERVICE, internal_pb2_grpc.JuryStub, jury_checkpoint, background_loop)


@pytest.fixture
def trunk(start_trunk) -> Service:
    return start_trunk()


@pytest.fixture
def jury(start_jury) -> Service:
    return start_jury()


class TurnPeer:
    """Another process's HostTurn on `path` (record locks belong to a process: one
    process's marks never stand in its own way), driven line by line: `ask("yields")`,
    `ask("mark_gathering")`, `ask("unmark_gathering")` answer what the method returned."""

    SCRIPT = (
        "import sys\n"
        "from hydra_jury.serving.host_turn import HostTurn\n"
        "turn = HostTurn(sys.argv[1], shared=sys.argv[2] == 'shared')\n"
        "for line in sys.stdin:\n"
        "    print(getattr(turn, line.strip())(), flush=True)\n"
    )

    def __init__(self, path, shared: bool) -> None:
        role = "shared" if shared else "alone"
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, str(path), role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, method: str) -> str:
        self.process.stdin.write(method + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
