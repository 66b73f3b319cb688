"""`hydra-jury certs`: a development CA, a server certificate for loopback and the names
given, and the orchestrator's client certificate, that load as the servers and clients
load them; private keys 0600, nothing overwritten."""

from __future__ import annotations

import ipaddress
import stat

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from hydra_jury.cli import main
from hydra_jury.serving.tls import CertificateDirectory, ClientTls, ServerTls, TlsFlags

FLAGS = TlsFlags("--test-tls")


def certificate(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_writes_files_that_load(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--name", "hydra.internal", "--name", "10.0.0.7"]) == 0
    directory = CertificateDirectory(out)
    assert capsys.readouterr().out.split() == [str(path) for path in directory.files]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for key in (directory.ca_key, directory.server_key, directory.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name

    server = ServerTls.load(directory.server_cert, directory.server_key, directory.ca)
    assert server is not None and server.mutual
    server.credentials()
    client = ClientTls.load(directory.ca, directory.client_cert, directory.client_key, flags=FLAGS)
    assert client is not None and client.identity is not None
    client.credentials()

    names = certificate(directory.server_cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert names.value.get_values_for_type(x509.DNSName) == ["localhost", "hydra.internal"]
    assert names.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.0.0.7"),
    ]
    usages = {
        path.name: list(
            certificate(path).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        )
        for path in (directory.server_cert, directory.client_cert)
    }
    assert usages == {
        "server.crt": [ExtendedKeyUsageOID.SERVER_AUTH],
        "client.crt": [ExtendedKeyUsageOID.CLIENT_AUTH],
    }
    authority = certificate(directory.ca).extensions.get_extension_for_class(x509.BasicConstraints)
    assert authority.value.ca


def test_certs_never_overwrites(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out)]) == 0
    before = (out / "ca.key").read_bytes()
    capsys.readouterr()
    assert main(["certs", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hydra-jury certs: error: {out} already holds ca.crt, ca.key")
    assert (out / "ca.key").read_bytes() == before


def test_certs_refuses_a_life_of_no_days(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "certs"), "--days", "0"]) == 2
    assert "--days must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "certs").exists()
