"""`hydra-jury up` hands its API-key flags to the stack's orchestrator."""

from pathlib import Path

from hydra_jury.cli import build_parser
from hydra_jury.cli.serve import _api_key_args


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
