"""Flags the commands pass on or refuse: `serve` and `up` take the HTTP API's address;
`up` hands its API-key flags to the stack's orchestrator; every server takes
--log-format (the orchestrator's config file too) and `up` passes it to every process;
`generate --local` refuses every connection flag; `--jury` lists heads; `serve` and the
worker services take the batching flags."""

import sys
from functools import partial
from pathlib import Path

import pytest

from hydra_jury.cli import build_parser, main
from hydra_jury.cli.serve import _api_key_args
from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.orchestrator.__main__ import build_parser as orchestrator_parser
from hydra_jury.orchestrator.config import ConfigFileError, OrchestratorConfig
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.flags import batch_limits_from
from hydra_jury.serving.worker_service import build_parser as service_parser
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from hydra_jury.workers.errors import InvalidArgument


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


SERVICE_ARGV = ["--checkpoint", "x"]


def test_up_gives_its_services_a_host_turn_unless_told_not_to():
    assert build_parser().parse_args(["up"]).host_turn is True
    assert build_parser().parse_args(["up", "--no-host-turn"]).host_turn is False
    for spec in (TRUNK_SERVICE, JURY_SERVICE):
        parser = service_parser(spec, "service")
        assert parser.parse_args(SERVICE_ARGV).host_turn is None
        assert parser.parse_args([*SERVICE_ARGV, "--host-turn", "/tmp/t"]).host_turn == "/tmp/t"


@pytest.mark.parametrize(
    ("parser", "argv"),
    [
        (build_parser, ["serve", "--checkpoint", "x"]),
        (build_parser, ["up"]),
        (partial(service_parser, TRUNK_SERVICE, "hydra-jury trunk"), SERVICE_ARGV),
        (partial(service_parser, JURY_SERVICE, "hydra-jury jury"), SERVICE_ARGV),
    ],
    ids=["serve", "up", "trunk", "jury"],
)
def test_the_servers_log_text_unless_told_json(parser, argv):
    assert parser().parse_args(argv).log_format == "text"
    assert parser().parse_args([*argv, "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        parser().parse_args([*argv, "--log-format", "xml"])


def test_the_orchestrator_takes_its_log_format_from_a_flag_or_its_config(tmp_path):
    assert orchestrator_parser().parse_args(["--log-format", "json"]).log_format == "json"
    required = {"checkpoint": "c", "trunk": "t", "jury": "j", "redis_url": "redis://h:1/0"}
    assert OrchestratorConfig.load(None, required).log_format == "text"
    path = tmp_path / "orchestrator.yaml"
    path.write_text("log_format: json\n")
    assert OrchestratorConfig.load(path, required).log_format == "json"
    path.write_text("log_format: xml\n")
    with pytest.raises(ConfigFileError, match="log_format must be one of text, json"):
        OrchestratorConfig.load(path, required)


def test_up_passes_the_log_format_to_every_process():
    stack = LocalStack("ckpt", log_format="json")
    for module in ("hydra_jury.trunk_service", "hydra_jury.jury_service"):
        assert stack.command(module, "--listen", "x")[:3] == [sys.executable, "-m", module]
        assert stack.command(module)[-2:] == ["--log-format", "json"]
    assert LocalStack("ckpt").command("hydra_jury.orchestrator")[-1] == "text"


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


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_a_system_message_is_refused_for_a_continued_session(command, capsys):
    argv = [*command, "--address", "127.0.0.1:1", "--system", "be brief", "--session", "s1"]
    assert main(argv) == 2
    assert "--system opens a new session; a continued session keeps its own" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("parser", "argv"),
    [
        (build_parser, ["serve", "--checkpoint", "x"]),
        (partial(service_parser, TRUNK_SERVICE, "hydra-jury trunk"), SERVICE_ARGV),
        (partial(service_parser, JURY_SERVICE, "hydra-jury jury"), SERVICE_ARGV),
    ],
    ids=["serve", "trunk", "jury"],
)
def test_the_servers_that_batch_take_the_batching_flags(parser, argv):
    assert batch_limits_from(parser().parse_args(argv)) == BatchLimits()
    flags = ["--max-batch-tokens", "64", "--max-queue", "8", "--max-queue-wait-s", "2"]
    flags += ["--prefill-chunk-tokens", "0", "--batch-window-ms", "0"]
    assert batch_limits_from(parser().parse_args([*argv, *flags])) == BatchLimits(
        64, 8, 2.0, 0, 0.0
    )
    with pytest.raises(InvalidArgument, match=r"--batch-window-ms must be in 0\.\.1000, got 2000"):
        batch_limits_from(parser().parse_args([*argv, "--batch-window-ms", "2000"]))


def test_serve_refuses_a_bad_batching_flag_in_one_line(capsys):
    assert main(["serve", "--checkpoint", "x", "--max-queue", "0"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hydra-jury serve: error: --max-batch-tokens and --max-queue must")
    assert "\n" not in line
