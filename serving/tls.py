"""TLS for every hop: a server's credentials (its certificate and key, and with a CA the
client certificates it requires: mTLS), a client's channel credentials (the CA it
verifies servers with, and its own certificate for an mTLS server), the files read and
checked first, so that a wrong file is one clear line at start-up instead of a failed
handshake on the first call.

Plaintext and TLS never mix by accident: a certificate without its key (or a key without
its certificate) is refused, not served in plaintext, and a client configured for TLS
opens only secure channels."""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

# gRPC's channel argument that replaces the host of the address as the name the server's
# certificate must carry: Kubernetes discovery connects to pod IPs, which no certificate
# names.
SERVER_NAME_OPTION = "grpc.ssl_target_name_override"


class TlsError(ValueError):
    """A TLS setting that cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TlsFlags:
    """The flags of one set of TLS settings, PREFIX-cert, -key, -ca and (a client's)
    -server-name: named by the messages, and read from the attributes argparse names
    after them (a configuration names its fields alike)."""

    prefix: str  # "--tls", "--internal-tls"

    @property
    def cert(self) -> str:
        return f"{self.prefix}-cert"

    @property
    def key(self) -> str:
        return f"{self.prefix}-key"

    @property
    def ca(self) -> str:
        return f"{self.prefix}-ca"

    @property
    def server_name(self) -> str:
        return f"{self.prefix}-server-name"

    def value(self, settings: object, flag: str) -> Any:
        """The value of `flag` in `settings` (parsed arguments or a configuration)."""
        return getattr(settings, flag.removeprefix("--").replace("-", "_"))


SERVER_FLAGS = TlsFlags("--tls")  # every server's


def _read(path: str | Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsError(f"{flag}: cannot read {path}: {error.strerror or error}") from None


def _certificates(path: str | Path, flag: str) -> tuple[bytes, list[x509.Certificate]]:
    """The PEM file at `path` and the certificates in it (at least one)."""
    pem = _read(path, flag)
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise TlsError(f"{flag}: {path} holds no PEM certificate") from None
    return pem, certificates


def _check_dates(certificate: x509.Certificate, path: str | Path, flag: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    if end < now:
        raise TlsError(f"{flag}: the certificate in {path} expired on {end:%Y-%m-%d %H:%M} UTC")
    if start > now:
        raise TlsError(
            f"{flag}: the certificate in {path} is valid only from {start:%Y-%m-%d %H:%M} UTC"
        )


def _key(path: str | Path, flag: str) -> tuple[bytes, PrivateKeyTypes]:
    pem = _read(path, flag)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as error:
        raise TlsError(f"{flag}: {path} is not an unencrypted PEM private key ({error})") from None
    return pem, key


@dataclass(frozen=True)
class KeyPair:
    """A certificate chain (leaf first) and its private key, as PEM, checked: the files
    read, the key the leaf's, the leaf valid now."""

    certificate_chain: bytes
    private_key: bytes
    # The files they were read from: Python's ssl (the HTTP API's listener) loads a
    # certificate and key from files only.
    files: tuple[Path, Path]

    @classmethod
    def load(cls, cert: str | Path, key: str | Path, flags: TlsFlags) -> KeyPair:
        chain, certificates = _certificates(cert, flags.cert)
        private_pem, private_key = _key(key, flags.key)
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        encoding = serialization.Encoding.DER
        if certificates[0].public_key().public_bytes(encoding, public) != (
            private_key.public_key().public_bytes(encoding, public)
        ):
            raise TlsError(
                f"{flags.key}: {key} is not the private key of the certificate in {cert}"
            )
        _check_dates(certificates[0], cert, flags.cert)
        return cls(chain, private_pem, (Path(cert), Path(key)))


def _load_ca(path: str | Path, flag: str) -> bytes:
    pem, certificates = _certificates(path, flag)
    for certificate in certificates:
        _check_dates(certificate, path, flag)
    return pem


def _key_pair(cert: str | Path | None, key: str | Path | None, flags: TlsFlags) -> KeyPair | None:
    """The certificate and key given together, or neither (None)."""
    if cert and not key:
        raise TlsError(f"{flags.cert} needs {flags.key} (the certificate's private key)")
    if key and not cert:
        raise TlsError(f"{flags.key} needs {flags.cert} (the key's certificate)")
    return KeyPair.load(cert, key, flags) if cert and key else None


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS: its certificate and key; with `client_ca`, mTLS (every client must
    present a certificate signed by it)."""

    identity: KeyPair
    client_ca: bytes | None = None

    @classmethod
    def load(
        cls,
        cert: str | Path | None,
        key: str | Path | None,
        ca: str | Path | None = None,
        flags: TlsFlags = SERVER_FLAGS,
    ) -> ServerTls | None:
        """None (plaintext) when no file is named; a `TlsError` for a partial or wrong
        set."""
        identity = _key_pair(cert, key, flags)
        if identity is None:
            if ca:
                raise TlsError(
                    f"{flags.ca} (the CA of the clients' certificates) needs the server's "
                    f"own {flags.cert} and {flags.key}"
                )
            return None
        return cls(identity, _load_ca(ca, flags.ca) if ca else None)

    @classmethod
    def from_settings(cls, settings: object, flags: TlsFlags = SERVER_FLAGS) -> ServerTls | None:
        """`load` of the flags' values in `settings`."""
        cert, key, ca = (flags.value(settings, flag) for flag in (flags.cert, flags.key, flags.ca))
        return cls.load(cert, key, ca, flags)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.identity.private_key, self.identity.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.mutual,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same TLS for an HTTP listener (Python's ssl): this certificate, and with a
        client CA every client's certificate required."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*self.identity.files)
        if self.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.client_ca.decode())
        return context


def transport(tls: ServerTls | None) -> str:
    """How a server's port is secured, for its log."""
    if tls is None:
        return "plaintext"
    return "mTLS" if tls.mutual else "TLS"


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS: the CA its servers' certificates are verified with, its own
    certificate for mTLS servers (None: none presented), and the name the servers'
    certificates must carry when it is not the host of the address (None: the host)."""

    ca: bytes
    identity: KeyPair | None = None
    server_name: str | None = None

    @classmethod
    def load(
        cls,
        ca: str | Path | None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
        *,
        flags: TlsFlags,
    ) -> ClientTls | None:
        """None (plaintext) when nothing is named; a `TlsError` for a partial or wrong
        set: a client certificate or a server name without the CA that verifies the
        servers would be TLS without verification."""
        identity = _key_pair(cert, key, flags)
        if not ca:
            given = [
                flag
                for flag, value in [(flags.cert, cert), (flags.server_name, server_name)]
                if value
            ]
            if given:
                raise TlsError(
                    f"{' and '.join(given)} need {flags.ca} (the CA that signed the servers' "
                    "certificates)"
                )
            return None
        return cls(_load_ca(ca, flags.ca), identity, server_name or None)

    @classmethod
    def from_settings(cls, settings: object, flags: TlsFlags) -> ClientTls | None:
        """`load` of the flags' values in `settings`."""
        names = (flags.ca, flags.cert, flags.key, flags.server_name)
        return cls.load(*(flags.value(settings, flag) for flag in names), flags=flags)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.identity.private_key if self.identity else None,
            certificate_chain=self.identity.certificate_chain if self.identity else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [(SERVER_NAME_OPTION, self.server_name)] if self.server_name else []


def open_channel(
    address: str, tls: ClientTls | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.Channel:
    """A channel to `address`: secure with `tls`, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(
        address, tls.credentials(), options=[*options, *tls.channel_options()]
    )


def unreachable_hint(tls: ClientTls | None, flag: str) -> str:
    """Why a server may not answer when the cause is the transport's security, for the
    message of a client that cannot reach it: a plaintext client at a TLS port, or a TLS
    client whose certificate the server refuses (or that refuses the server's)."""
    if tls is None:
        return f" (if its port is TLS, connect with {flag})"
    return (
        " (if its port is TLS: is its certificate signed by the CA given, for the name "
        "connected to, and does it accept this client's certificate?)"
    )


@dataclass(frozen=True)
class CertificateDirectory:
    """The files `hydra-jury certs` writes into one directory: a development CA, a
    server certificate every service of the local stack shares, and the orchestrator's
    client certificate (each key beside its certificate)."""

    path: Path

    @property
    def ca(self) -> Path:
        return self.path / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.path / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.path / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.path / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.path / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.path / "client.key"

    @property
    def files(self) -> list[Path]:
        return [
            self.ca,
            self.ca_key,
            self.server_cert,
            self.server_key,
            self.client_cert,
            self.client_key,
        ]
