"""TLS files read and checked at start-up (`serving.tls`), each wrong set one line naming
the flag and the file; a worker service refusing them before it loads anything; the
plaintext health port beside a TLS port (`serving.health_port`)."""

from __future__ import annotations

import datetime

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydra_jury.cli.certs import Validity, issue, make_certificates, new_authority
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving.health_port import HEALTH_MESSAGE_LIMIT, health_port
from hydra_jury.serving.tls import ClientTls, ServerTls, TlsError, TlsFlags, open_channel
from hydra_jury.serving.worker_service import service_main
from hydra_jury.trunk_service.server import TRUNK_SERVICE

CLIENT_FLAGS = TlsFlags("--c")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("tls") / "certs")


def test_a_full_set_loads(certificates):
    tls = ServerTls.load(certificates.server_cert, certificates.server_key)
    assert tls is not None and not tls.mutual
    assert ServerTls.load(None, None) is None
    assert ClientTls.load(None, flags=CLIENT_FLAGS) is None


def server_error(certificates, tmp_path, cert, key, ca) -> str:
    files = {
        "server.crt": certificates.server_cert,
        "server.key": certificates.server_key,
        "client.key": certificates.client_key,
        "ca.crt": certificates.ca,
        "missing.crt": tmp_path / "missing.crt",
        "text.crt": tmp_path / "text.crt",
        "text.key": tmp_path / "text.key",
    }
    (tmp_path / "text.crt").write_text("not a certificate\n")
    (tmp_path / "text.key").write_text("not a key\n")
    with pytest.raises(TlsError) as raised:
        ServerTls.load(*(files[name] if name else None for name in (cert, key, ca)))
    return str(raised.value)


@pytest.mark.parametrize(
    ("cert", "key", "ca", "message"),
    [
        ("server.crt", None, None, "--tls-cert needs --tls-key"),
        (None, "server.key", None, "--tls-key needs --tls-cert"),
        (None, None, "ca.crt", "--tls-ca (the CA of the clients' certificates) needs the"),
        ("missing.crt", "server.key", None, "--tls-cert: cannot read {missing.crt}: No such file"),
        ("text.crt", "server.key", None, "--tls-cert: {text.crt} holds no PEM certificate"),
        ("server.crt", "text.key", None, "--tls-key: {text.key} is not an unencrypted PEM"),
        (
            "server.crt",
            "client.key",
            None,
            "--tls-key: {client.key} is not the private key of the certificate in {server.crt}",
        ),
        ("server.crt", "server.key", "text.crt", "--tls-ca: {text.crt} holds no PEM certificate"),
    ],
)
def test_a_wrong_server_set_is_one_clear_line(certificates, tmp_path, cert, key, ca, message):
    paths = {
        "{missing.crt}": tmp_path / "missing.crt",
        "{text.crt}": tmp_path / "text.crt",
        "{text.key}": tmp_path / "text.key",
        "{client.key}": certificates.client_key,
        "{server.crt}": certificates.server_cert,
    }
    for name, path in paths.items():
        message = message.replace(name, str(path))
    assert message in server_error(certificates, tmp_path, cert, key, ca)


def test_an_expired_or_future_certificate_is_refused(tmp_path):
    authority = new_authority("test CA", Validity.days(1))
    now = datetime.datetime.now(datetime.UTC)
    for name, validity, message in [
        (
            "old",
            Validity(now - datetime.timedelta(days=3), now - datetime.timedelta(days=1)),
            "expired on",
        ),
        (
            "new",
            Validity(now + datetime.timedelta(days=1), now + datetime.timedelta(days=3)),
            "is valid only from",
        ),
    ]:
        issued = issue(authority, name, validity, server_names=["localhost"])
        (tmp_path / f"{name}.crt").write_bytes(issued.certificate_pem())
        (tmp_path / f"{name}.key").write_bytes(issued.key_pem())
        with pytest.raises(
            TlsError, match=f"--tls-cert: the certificate in .*{name}.crt {message}"
        ):
            ServerTls.load(tmp_path / f"{name}.crt", tmp_path / f"{name}.key")


def test_a_client_set_needs_the_ca_that_verifies_the_servers(certificates):
    with pytest.raises(TlsError, match="--c-cert and --c-server-name need --c-ca"):
        ClientTls.load(
            None,
            certificates.client_cert,
            certificates.client_key,
            "hydra.internal",
            flags=CLIENT_FLAGS,
        )
    with pytest.raises(TlsError, match="--c-cert needs --c-key"):
        ClientTls.load(certificates.ca, certificates.client_cert, flags=CLIENT_FLAGS)


def test_a_service_with_a_mismatched_key_refuses_to_start(jury_checkpoint, certificates, capsys):
    argv = ["--checkpoint", str(jury_checkpoint), "--listen", "127.0.0.1:0"]
    argv += ["--tls-cert", str(certificates.server_cert), "--tls-key", str(certificates.client_key)]
    assert service_main(TRUNK_SERVICE, argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"trunk service: error: --tls-key: {certificates.client_key} is not the private key "
        f"of the certificate in {certificates.server_cert}"
    )


def test_the_health_port_serves_health_alone_in_plaintext(
    start_trunk, background_loop, certificates
):
    """A TLS trunk's health on a plaintext port of its own, for probes that cannot do
    TLS: SERVING for the server and its service, nothing else served there; the port
    closes with the server."""
    tls = ServerTls.load(certificates.server_cert, certificates.server_key, certificates.ca)
    trunk = start_trunk(tls=tls)
    port_scope = health_port(trunk.running, "127.0.0.1:0")
    port = background_loop.run(port_scope.__aenter__())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", TRUNK_SERVICE.service_name):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            internal_pb2_grpc.TrunkStub(channel).Info(internal_pb2.InfoRequest(), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # An open port takes no more than a health check needs (not the services' 256 MiB).
        oversized = health_pb2.HealthCheckRequest(service="x" * (HEALTH_MESSAGE_LIMIT + 1))
        with pytest.raises(grpc.RpcError) as raised:
            health.Check(oversized, timeout=5)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        background_loop.run(trunk.running.server.stop(0))
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        background_loop.run(port_scope.__aexit__(None, None, None))
        with pytest.raises(grpc.RpcError) as raised:
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    client = ClientTls.load(
        certificates.ca, certificates.client_cert, certificates.client_key, flags=CLIENT_FLAGS
    )
    with open_channel(trunk.address, client) as channel, pytest.raises(grpc.RpcError):
        # the TLS port is closed too
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_health_port_that_cannot_bind_stops_the_server(start_trunk, background_loop):
    trunk = start_trunk()
    taken = f"127.0.0.1:{trunk.port}"

    async def enter() -> None:
        async with health_port(trunk.running, taken):
            pytest.fail("entered with a port in use")

    with pytest.raises(OSError, match=f"--health-listen: cannot bind {taken}"):
        background_loop.run(enter())
    with pytest.raises(grpc.RpcError) as raised:
        trunk.stub.Info(internal_pb2.InfoRequest(), timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
