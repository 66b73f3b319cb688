"""How the client commands (`generate --address`, `chat`) connect to a server's public
port: plaintext, or TLS with --tls-ca (and a client certificate for a port that requires
one)."""

from __future__ import annotations

import argparse

from hydra_jury.serving.flags import add_client_tls_flags
from hydra_jury.serving.tls import ClientTls, TlsFlags, unreachable_hint

CLIENT_TLS_FLAGS = TlsFlags("--tls")


def add_server_tls_flags(parser: argparse.ArgumentParser) -> None:
    flags = CLIENT_TLS_FLAGS
    add_client_tls_flags(
        parser,
        flags,
        "TLS",
        f"with {flags.ca} the connection is TLS (for a server started with {flags.cert})",
        "the server",
    )


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The flags' TLS, its files read and checked (None: plaintext)."""
    return ClientTls.from_settings(args, CLIENT_TLS_FLAGS)


def unreachable(tls: ClientTls | None) -> str:
    """What to add to a message saying the server could not be reached."""
    return unreachable_hint(tls, CLIENT_TLS_FLAGS.ca)


def tls_flags_given(args: argparse.Namespace) -> list[str]:
    """The TLS flags set on the command line (for commands that make no connection)."""
    flags = CLIENT_TLS_FLAGS
    named = (flags.cert, flags.key, flags.ca, flags.server_name)
    return [flag for flag in named if flags.value(args, flag)]
