"""Flags the commands pass on or refuse: `serve` and `up` take the HTTP API's address;
`up` hands its API-key flags to the stack's orchestrator; `generate --local` refuses
every connection flag; `--jury` lists heads."""

from pathlib import Path

import pytest

from hydra_jury.cli import build_parser, main
from hydra_jury.cli.serve import _api_key_args


@pytest.mark.parametrize("command", [["serve", "--checkpoint", "x"], ["up"]])
def test_serve_and_up_take_an_http_address_off_by_default(command):
    args = build_parser().parse_args(
        [*command, "--http-listen", "127.0.0.1:8080", "--served-model-name", "demo"]
    )
    assert (args.http_listen, args.served_model_name) == ("127.0.0.1:8080", "demo")
    plain = build_parser().parse_args(command)
    assert plain.http_listen is None and plain.served_model_name is None


def test_up_passes_the_api_key_flags_to_the_orchestrator(tmp_path):
    keys = tmp_path / "api-keys"
    args = build_parser().parse_args(
        ["up", "--api-keys", str(keys), "--auth-health", "--tokens-per-minute-per-key", "600"]
    )
    assert _api_key_args(args) == [
        *("--api-keys", str(Path(keys).resolve()), "--auth-health"),
        *("--tokens-per-minute-per-key", "600"),
    ]
    assert _api_key_args(build_parser().parse_args(["up"])) == []


@pytest.mark.parametrize(
    "flag", ["--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name", "--api-key"]
)
def test_generate_local_refuses_the_flags_of_a_connection(flag, capsys):
    assert main(["generate", "--local", flag, "x", "hi"]) == 2
    error = capsys.readouterr().err
    assert flag in error and "(--address)" in error, error


def test_a_jury_list_is_heads_with_the_spaces_stripped():
    args = build_parser().parse_args(["generate", "--local", "--jury", "head1, head2", "hi"])
    assert args.jury == ["head1", "head2"]
