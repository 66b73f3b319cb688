"""mTLS on every internal hop and TLS on the public port, over real servers on loopback
with certificates made by `hydra-jury certs`' module: the same tokens as the plaintext
stack; an mTLS service refusing a client without a certificate, with an expired one, with
one another CA signed, and a plaintext client; an orchestrator that is not configured for
the services' TLS refused with a message saying why; the CLI over TLS; `up --tls`."""

from __future__ import annotations

import datetime
import json
import re

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydra_jury.cli import main
from hydra_jury.cli.certs import Issued, Validity, issue, make_certificates, new_authority
from hydra_jury.orchestrator.__main__ import main as orchestrator_main
from hydra_jury.orchestrator.config import OrchestratorConfig
from hydra_jury.orchestrator.discovery import StaticDiscovery
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.server import serve_orchestrator
from hydra_jury.protos.hydrajury.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    internal_pb2,
    internal_pb2_grpc,
)
from hydra_jury.serving.errors import ServiceUnavailable
from hydra_jury.serving.tls import CertificateDirectory, ClientTls, TlsFlags, open_channel
from tests.grpc_stack import Stack

SHARDS = [["head0", "head1"], ["head2", "head3"]]
FLAGS = TlsFlags("--test-tls")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> CertificateDirectory:
    return make_certificates(tmp_path_factory.mktemp("tls") / "certs")


@pytest.fixture(scope="module")
def tls_stack(jury_checkpoint, redis_url, certificates):
    stack = Stack(str(jury_checkpoint), SHARDS, redis_url, tls=certificates)
    stack.start_services().start_orchestrator()
    yield stack
    stack.close()


def request(**options) -> generation_pb2.GenerateRequest:
    options = {"max_new_tokens": 16, "seed": 5, "ignore_eos": True, **options}
    return generation_pb2.GenerateRequest(
        prompt="the cat", options=generation_pb2.DecodingOptions(**options)
    )


CASES = [
    {"temperature": 0.0, "gamma": 3, "drafter": "head"},
    {"temperature": 0.9, "gamma": 4, "top_k": 10, "drafter": "head"},
    {"rule": "verifier_only", "temperature": 0.8},
]


def test_the_tls_stack_gives_the_plaintext_stack_tokens(tls_stack, jury_checkpoint, redis_url):
    plain = Stack(str(jury_checkpoint), SHARDS, redis_url)
    try:
        plain.start_services().start_orchestrator()
        for case in CASES:
            expected = plain.generation().Generate(request(**case), timeout=30)
            response = tls_stack.generation().Generate(request(**case), timeout=30)
            assert list(response.token_ids) == list(expected.token_ids), case
            assert response.stats.rounds == expected.stats.rounds
    finally:
        plain.close()


def authority_of(certificates: CertificateDirectory) -> Issued:
    return Issued(
        load_pem_private_key(certificates.ca_key.read_bytes(), password=None),
        x509.load_pem_x509_certificate(certificates.ca.read_bytes()),
    )


def credentials(certificates: CertificateDirectory, client: str) -> grpc.ChannelCredentials:
    """A channel that trusts the stack's CA, presenting `client`'s certificate."""
    ca = certificates.ca.read_bytes()
    now = datetime.datetime.now(datetime.UTC)
    if client == "none":
        return grpc.ssl_channel_credentials(ca)
    if client == "the stack's":
        issued = issue(authority_of(certificates), "client", Validity.days(1))
    elif client == "expired":
        expired = Validity(now - datetime.timedelta(days=2), now - datetime.timedelta(days=1))
        issued = issue(authority_of(certificates), "client", expired)
    else:  # another CA's
        issued = issue(new_authority("another CA", Validity.days(1)), "client", Validity.days(1))
    return grpc.ssl_channel_credentials(ca, issued.key_pem(), issued.certificate_pem())


@pytest.mark.parametrize("service", ["trunk", "jury0"])
@pytest.mark.parametrize("client", ["the stack's", "none", "expired", "another CA's", "plaintext"])
def test_an_mtls_service_takes_only_clients_its_ca_signed(tls_stack, certificates, service, client):
    address = tls_stack.addresses[service]
    if client == "plaintext":
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials(certificates, client))
    with channel:
        stub = tls_stack.workers[service](channel)
        if client == "the stack's":  # the control: the refusals below are the certificates'
            assert stub.Info(internal_pb2.InfoRequest(), timeout=10).epoch
            return
        with pytest.raises(grpc.RpcError) as raised:
            stub.Info(internal_pb2.InfoRequest(), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert address.rsplit(":", 1)[1] in raised.value.details()


@pytest.mark.parametrize(
    ("internal_tls", "message"),
    [
        (None, "(if its port is TLS, connect with --internal-tls-ca)"),
        ("no client certificate", "does it accept this client's certificate?"),
    ],
)
def test_an_orchestrator_not_set_up_for_the_services_tls_is_refused(
    tls_stack, certificates, internal_tls, message
):
    client = None
    if internal_tls is not None:
        client = ClientTls.load(certificates.ca, flags=FLAGS)
    with pytest.raises(ServiceUnavailable) as raised:
        tls_stack.loop.run(
            serve_orchestrator(
                checkpoint=tls_stack.checkpoint,
                discovery=StaticDiscovery(tls_stack.addresses["trunk"], tls_stack.jury_addresses),
                store=tls_stack.store(),
                connect_timeout_s=1,
                internal_tls=client,
            )
        )
    assert str(raised.value).startswith(
        f"trunk service at {tls_stack.addresses['trunk']} did not answer Info"
    )
    assert message in str(raised.value)


def test_a_wrong_server_name_is_refused(tls_stack, certificates):
    """The orchestrator verifies the name the services' certificates carry: the server
    name override must be one of them."""
    wrong = ClientTls.load(
        certificates.ca,
        certificates.client_cert,
        certificates.client_key,
        "hydra.elsewhere",
        flags=FLAGS,
    )
    right = ClientTls.load(
        certificates.ca, certificates.client_cert, certificates.client_key, "localhost", flags=FLAGS
    )
    info = internal_pb2.InfoRequest()
    with open_channel(tls_stack.addresses["trunk"], right) as channel:
        assert internal_pb2_grpc.TrunkStub(channel).Info(info, timeout=10).epoch
    with (
        open_channel(tls_stack.addresses["trunk"], wrong) as channel,
        pytest.raises(grpc.RpcError) as raised,
    ):
        internal_pb2_grpc.TrunkStub(channel).Info(info, timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def generate_argv(address: str, *flags: str) -> list[str]:
    return [
        *("generate", "--address", address, "hi", "--no-chat", "--json"),
        *("--max-new-tokens", "6", "--seed", "2", "--ignore-eos", *flags),
    ]


def test_the_cli_connects_over_tls_and_says_why_plaintext_fails(tls_stack, certificates, capsys):
    address = tls_stack.addresses["orchestrator"]
    assert main(generate_argv(address, "--tls-ca", str(certificates.ca))) == 0
    assert len(json.loads(capsys.readouterr().out)["tokenIds"]) == 6
    assert main(generate_argv(address)) == 2
    error = capsys.readouterr().err
    assert error.startswith("hydra-jury generate: error: UNAVAILABLE: ")
    assert "(if its port is TLS, connect with --tls-ca)" in error


def test_the_configuration_file_takes_the_tls_keys(certificates, tmp_path):
    settings = {
        "checkpoint": "ckpt",
        "trunk": "127.0.0.1:1",
        "jury": ["127.0.0.1:2"],
        "redis_url": "redis://127.0.0.1:1/0",
        "tls_cert": str(certificates.server_cert),
        "tls_key": str(certificates.server_key),
        "tls_ca": str(certificates.ca),
        "health_listen": "0.0.0.0:50059",
        "internal_tls_ca": str(certificates.ca),
        "internal_tls_cert": str(certificates.client_cert),
        "internal_tls_key": str(certificates.client_key),
        "internal_tls_server_name": "hydra.internal",
    }
    path = tmp_path / "orchestrator.yaml"
    path.write_text(yaml.safe_dump(settings))
    config = OrchestratorConfig.load(path, {})
    server, client = config.server_tls(), config.internal_tls()
    assert server is not None and server.mutual and config.health_listen == "0.0.0.0:50059"
    assert client is not None and client.identity is not None
    assert client.server_name == "hydra.internal"


def test_the_orchestrator_refuses_a_certificate_without_its_key(certificates, capsys):
    argv = [
        *("--checkpoint", "ckpt", "--trunk", "127.0.0.1:1", "--jury", "127.0.0.1:2"),
        *("--redis-url", "redis://127.0.0.1:1/0", "--tls-cert", str(certificates.server_cert)),
    ]
    assert orchestrator_main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "orchestrator: error: --tls-cert needs --tls-key (the certificate's private key)"
    )
    argv[-2:] = ["--internal-tls-server-name", "hydra.internal"]
    assert orchestrator_main(argv) == 2
    assert "--internal-tls-server-name need --internal-tls-ca" in capsys.readouterr().err


def test_the_single_process_server_serves_tls(jury_checkpoint, redis_url, certificates, capsys):
    stack = Stack(str(jury_checkpoint), [], redis_url, tls=certificates)
    try:
        stack.start_embedded(tls=stack.server_tls(mutual=False))
        assert len(stack.generation().Generate(request(), timeout=30).token_ids) == 16
        with (
            grpc.insecure_channel(stack.addresses["orchestrator"]) as channel,
            pytest.raises(grpc.RpcError) as raised,
        ):
            generation_pb2_grpc.GenerationStub(channel).Info(
                generation_pb2.GenerationInfoRequest(), timeout=10
            )
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.close()
    argv = ["serve", "--checkpoint", str(jury_checkpoint), "--tls-key", str(certificates.ca_key)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "hydra-jury serve: error: --tls-key needs --tls-cert (the key's certificate)"
    )


def test_up_with_tls_serves_over_tls(jury_checkpoint, redis_url, tmp_path, capsys):
    """`hydra-jury up --tls --api-keys FILE`'s stack: mTLS services, the orchestrator their
    client and a TLS server that wants a key; a client that trusts the CA and sends the
    key generates, one without the key or without TLS is refused. The services'
    plaintext health ports (--health-listen) answer a probe without TLS."""
    certificates = make_certificates(tmp_path / "certs")
    key = "a-key-of-the-local-stack"
    (tmp_path / "api-keys").write_text(f"dev:{key}\n")
    stack = LocalStack(
        str(jury_checkpoint),
        shards=1,
        port=0,
        redis_url=redis_url,
        shard_threads=1,
        extra_service_args=["--max-session-tokens", "128", "--health-listen", "127.0.0.1:0"],
        tls=certificates,
        orchestrator_args=["--api-keys", str(tmp_path / "api-keys")],
    )
    try:
        address = stack.start(timeout_s=120)
        started = capsys.readouterr().err
        health_ports = re.findall(r"grpc\.health\.v1 in plaintext on 127\.0\.0\.1:(\d+)", started)
        assert len(health_ports) == 2  # the trunk's and the shard's
        for port in health_ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        trusted = generate_argv(address, "--tls-ca", str(certificates.ca))
        assert main([*trusted, "--api-key", key]) == 0
        assert len(json.loads(capsys.readouterr().out)["tokenIds"]) == 6
        assert main(trusted) == 2
        assert "UNAUTHENTICATED: this server requires an API key" in capsys.readouterr().err
        assert main(generate_argv(address)) == 2
        assert "connect with --tls-ca" in capsys.readouterr().err
    finally:
        codes = stack.stop()
    assert codes == {"trunk": 0, "jury0": 0, "orchestrator": 0}
