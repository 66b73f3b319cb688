"""How the client commands (`generate --address`, `chat`) connect to a server's public
port: plaintext, or TLS with --tls-ca (and a client certificate for a port that requires
one)."""

from __future__ import annotations

import argparse

from hydra_jury.serving.tls import ClientTls, TlsFlags, unreachable_hint

CLIENT_TLS_FLAGS = TlsFlags("--tls-cert", "--tls-key", "--tls-ca")
SERVER_NAME_FLAG = "--tls-server-name"


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "TLS", "with --tls-ca the connection is TLS (for a server started with --tls-cert)"
    )
    group.add_argument(
        CLIENT_TLS_FLAGS.ca,
        metavar="FILE",
        help="the CA (PEM) that signed the server's certificate",
    )
    group.add_argument(
        CLIENT_TLS_FLAGS.cert,
        metavar="FILE",
        help="a client certificate (PEM), for a server that requires one (its --tls-ca)",
    )
    group.add_argument(CLIENT_TLS_FLAGS.key, metavar="FILE", help="its private key (PEM)")
    group.add_argument(
        SERVER_NAME_FLAG,
        metavar="NAME",
        help="the name the server's certificate must carry, when not the address's host",
    )


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The flags' TLS, its files read and checked (None: plaintext)."""
    return ClientTls.load(
        args.tls_ca,
        args.tls_cert,
        args.tls_key,
        args.tls_server_name,
        flags=CLIENT_TLS_FLAGS,
        server_name_flag=SERVER_NAME_FLAG,
    )


def unreachable(tls: ClientTls | None) -> str:
    """What to add to a message saying the server could not be reached."""
    return unreachable_hint(tls, CLIENT_TLS_FLAGS.ca)
