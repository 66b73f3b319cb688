"""`hydra-jury certs`: a development certificate authority and the certificates of a
stack signed by it, for trying TLS and mTLS on one host (`hydra-jury up --tls` makes its
own). Not for production: there, certificates come from your CA or cert-manager.

Keys are ECDSA P-256 (fast to make, supported by every gRPC), written 0600. The server
certificate names `localhost`, `127.0.0.1` and every `--name`; the client certificate
is the orchestrator's, for the services' mTLS ports."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hydra_jury.serving.tls import CertificateDirectory

DAYS = 30  # a development certificate's life
LOCAL_NAMES = ("localhost", "127.0.0.1")
# Signed a little in the past, so that a host whose clock is slightly behind accepts it.
CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Issued:
    """A private key and its certificate."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Validity:
    not_before: datetime.datetime
    not_after: datetime.datetime

    @classmethod
    def days(cls, days: int) -> Validity:
        """From now (less the clock skew) for `days` days."""
        now = datetime.datetime.now(datetime.UTC)
        return cls(now - CLOCK_SKEW, now + datetime.timedelta(days=days))


def _subject(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hydra-jury development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, key, validity: Validity):
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity.not_before)
        .not_valid_after(validity.not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def new_authority(common_name: str, validity: Validity) -> Issued:
    """A self-signed CA that signs leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _subject(common_name)
    certificate = (
        _builder(subject, subject, key, validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(key, certificate)


def _alternative_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue(
    authority: Issued,
    common_name: str,
    validity: Validity,
    *,
    server_names: Sequence[str] = (),
) -> Issued:
    """A leaf certificate signed by `authority`: a server's for `server_names` (DNS
    names or IP addresses), else a client's."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(_subject(common_name), authority.certificate.subject, key, validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
            critical=False,
        )
    )
    if server_names:
        names = [_alternative_name(name) for name in dict.fromkeys(server_names)]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issued(key, builder.sign(authority.key, hashes.SHA256()))


def _write(path: Path, data: bytes, mode: int) -> None:
    """Creates `path` with `mode` from the start (a key is never readable by others, not
    even for a moment); an existing file is an error."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def make_certificates(
    out: str | Path, names: Sequence[str] = (), days: int = DAYS
) -> CertificateDirectory:
    """Writes a CA, a server certificate for `LOCAL_NAMES` and `names`, and a client
    certificate into `out` (created 0700 if new); refuses to overwrite."""
    if days < 1:
        raise ValueError(f"--days must be at least 1, got {days}")
    directory = CertificateDirectory(Path(out))
    present = [path.name for path in directory.files if path.exists()]
    if present:
        raise FileExistsError(
            f"{out} already holds {', '.join(present)}: remove them or choose another --out"
        )
    directory.path.mkdir(mode=0o700, parents=True, exist_ok=True)
    validity = Validity.days(days)
    authority = new_authority("hydra-jury development CA", validity)
    server = issue(authority, "hydra-jury server", validity, server_names=[*LOCAL_NAMES, *names])
    client = issue(authority, "hydra-jury orchestrator", validity)
    for issued, cert, key in [
        (authority, directory.ca, directory.ca_key),
        (server, directory.server_cert, directory.server_key),
        (client, directory.client_cert, directory.client_key),
    ]:
        _write(key, issued.key_pem(), 0o600)
        _write(cert, issued.certificate_pem(), 0o644)
    return directory


def add_commands(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "certs",
        help="make a development CA and TLS certificates for a stack",
        description="Write a development CA (ca.crt, ca.key), a server certificate "
        f"(server.crt, server.key) for {' and '.join(LOCAL_NAMES)} and every --name, and a "
        "client certificate for the orchestrator (client.crt, client.key) into --out; keys "
        "are 0600. For trying TLS on one host: `up --tls` makes its own.",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write them")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help="one more DNS name or IP address for the server certificate (repeatable)",
    )
    parser.add_argument(
        "--days", type=int, default=DAYS, help="how long they are valid (%(default)s)"
    )
    parser.set_defaults(handler=_run_certs)


def _run_certs(args: argparse.Namespace) -> int:
    directory = make_certificates(args.out, args.name, args.days)
    for path in directory.files:
        print(path)
    return 0
