"""The API key interceptor on a bare server (health and reflection only): health checks
and reflection open by default and protected on request — reflection's streaming
requests included —, refusals that say what was wrong, and the client side that sends
the key."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hydra_jury.serving.api_keys import KeyFile, KeyLimits
from hydra_jury.serving.auth import ApiKeyInterceptor, auth_from, refusal, with_api_key
from hydra_jury.serving.server import GrpcServer
from tests.grpc_stack import BackgroundLoop

KEY = "operator-key-0123456789"


@pytest.fixture(params=[False, True], ids=["open-health", "protected-health"])
def served(request, tmp_path):
    """(address, whether health and reflection need a key, the refusals reported)."""
    path = tmp_path / "keys"
    path.write_text(f"operator:{KEY}\n")
    refused: list[str] = []
    interceptor = ApiKeyInterceptor(
        KeyFile(path),
        protect_open_services=request.param,
        on_refused=lambda reason, method: refused.append(reason),
    )

    async def start() -> tuple[GrpcServer, int]:
        # An aio server belongs to the event loop it is made on.
        server = GrpcServer(lambda server: None, [], interceptors=[interceptor])
        return server, await server.start("127.0.0.1:0")

    loop = BackgroundLoop()
    server, port = loop.run(start())
    yield f"127.0.0.1:{port}", request.param, refused
    loop.run(server.stop(0))
    loop.close()


def check_health(channel: grpc.Channel, metadata=()) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=metadata).status


def list_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    answers = stub.ServerReflectionInfo(iter([request]), timeout=5)
    return {s.name for answer in answers for s in answer.list_services_response.service}


def test_health_and_reflection_are_open_unless_protected(served):
    address, protected, refused = served
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(address) as channel:
        if not protected:
            assert check_health(channel) == serving
            assert "grpc.health.v1.Health" in list_services(channel)
            assert refused == []
            return
        for call in (check_health, list_services):  # unary and streaming requests
            with pytest.raises(grpc.RpcError) as raised:
                call(channel)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert raised.value.details() == refusal("missing")
        keyed = with_api_key(channel, KEY)
        assert check_health(keyed) == serving
        assert "grpc.health.v1.Health" in list_services(keyed)
        assert refused == ["missing", "missing"]


@pytest.mark.parametrize("served", [True], ids=["protected-health"], indirect=True)
@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("Bearer wrong-key-000000000000", "unknown"),
        (f"Basic {KEY}", "malformed"),
        ("Bearer", "malformed"),
        (f"bearer {KEY}", None),  # the scheme is case-insensitive
    ],
)
def test_what_a_refusal_says(served, value, reason):
    address, _protected, refused = served
    with grpc.insecure_channel(address) as channel:
        metadata = (("authorization", value),)
        if reason is None:
            assert check_health(channel, metadata) == health_pb2.HealthCheckResponse.SERVING
            return
        with pytest.raises(grpc.RpcError) as raised:
            check_health(channel, metadata)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert raised.value.details() == refusal(reason) and KEY not in raised.value.details()
    assert refused == [reason]


class Settings:
    def __init__(self, api_keys=None, auth_health=None, concurrent=None, per_minute=None):
        self.api_keys, self.auth_health = api_keys, auth_health
        self.max_concurrent_per_key, self.tokens_per_minute_per_key = concurrent, per_minute


def test_settings_without_a_key_file(tmp_path):
    assert auth_from(Settings()) is None
    assert auth_from(Settings(concurrent=0, per_minute=0)) is None  # 0: no limit
    for settings, given in (
        (Settings(auth_health=True), "--auth-health"),
        (Settings(concurrent=2), "--max-concurrent-per-key"),
        (Settings(per_minute=9, auth_health=True), "--tokens-per-minute-per-key and --auth-health"),
    ):
        with pytest.raises(ValueError, match=f"^{given} need API keys: give --api-keys FILE too$"):
            auth_from(settings)
    path = tmp_path / "keys"
    path.write_text(f"operator:{KEY}\n")
    auth = auth_from(Settings(str(path), True, 3, 0))
    assert auth.protect_open_services
    assert auth.keys.keys.find(KEY).limits == KeyLimits(max_concurrent=3)
    with pytest.raises(ValueError) as raised:
        auth_from(Settings(str(path), concurrent=-1))
    assert str(raised.value) == "--max-concurrent-per-key must be 0 (no limit) or more, got -1"
