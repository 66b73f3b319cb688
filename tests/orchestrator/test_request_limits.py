"""The hard limits on one request (`RequestLimits`): each refused before any compute with
a detail naming the limit and its flag, the flags of both Generation servers and the
orchestrator's config keys, and over gRPC the public port's message size and the running
time of one generation, which stops resumably."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import grpc
import pytest

from hydra_jury.cli import main
from hydra_jury.orchestrator.__main__ import SETTINGS, build_parser
from hydra_jury.orchestrator.config import OrchestratorConfig
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.flags import add_request_limit_flags
from hydra_jury.orchestrator.limits import RequestLimits, limit_flag, limit_setting, limits_from
from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.workers.errors import CapacityError
from tests.grpc_stack import Stack

Code = grpc.StatusCode
SMALL = RequestLimits(
    message_bytes=2048,
    prompt_tokens=20,
    new_tokens=30,
    stop_sequences=2,
    stop_chars=5,
    beams=3,
    stream_s=30.0,
    sessions_per_key=2,
)


@pytest.fixture
def limited(engine, tokenizer) -> Engine:
    return Engine(engine.backend, tokenizer, SMALL)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"prompt": "a" * 21},
            r"the context of 21 tokens is over this server's limit of 20 "
            r"\(--limit-prompt-tokens\): send a shorter prompt or start a new session",
        ),
        (
            {"max_new_tokens": 31},
            r"max_new_tokens=31 is over this server's limit of 30 \(--limit-new-tokens\)",
        ),
        (
            {"stop": ["a", "b", "c"]},
            r"3 stop sequences is over this server's limit of 2 \(--limit-stop-sequences\)",
        ),
        (
            {"stop": ["ab", "abcdef"]},
            r"stop sequence 1 of 6 characters is over this server's limit of 5 "
            r"\(--limit-stop-chars\)",
        ),
        (
            {"num_beams": 4, "temperature": 0.0},
            r"num_beams=4 is over this server's limit of 3 \(--limit-beams\)",
        ),
    ],
    ids=["prompt tokens", "new tokens", "stop sequences", "stop length", "beams"],
)
def test_each_limit_is_refused_naming_its_flag(limited, options, message):
    with pytest.raises(RequestError, match=message):
        limited.prepare(GenerationRequest(**{"prompt": "hi", "max_new_tokens": 8, **options}))


def test_a_request_at_every_limit_is_taken(limited):
    prepared = limited.prepare(
        GenerationRequest(prompt="a" * 20, max_new_tokens=30, stop=["abcde", "x"])
    )
    assert len(prepared.prompt_tokens) == 20
    limited.prepare(GenerationRequest(prompt="hi", max_new_tokens=8, num_beams=3, temperature=0.0))


def test_the_prompt_limit_counts_the_conversation_a_turn_continues(limited):
    with pytest.raises(RequestError, match=r"the context of 25 tokens is over"):
        limited.prepare(GenerationRequest(prompt="hi", max_new_tokens=4), context=[5] * 25)


def test_an_engine_without_limits_has_only_the_model_s(engine):
    engine.prepare(GenerationRequest(prompt="a" * 60, max_new_tokens=60, stop=["abcdef"] * 20))


def test_limits_must_be_positive():
    for name in ("message_bytes", "stream_s", "sessions_per_key"):
        with pytest.raises(ValueError, match=rf"{limit_flag(name)} must be positive, got 0"):
            RequestLimits(**{name: 0})


def test_sessions_per_key_is_a_capacity_limit():
    SMALL.check_sessions_per_key("alice", 1)
    with pytest.raises(
        CapacityError,
        match=re.escape(
            "API key 'alice' holds 2 open sessions, this server's limit of 2 "
            "(--limit-sessions-per-key): close one (CloseSession) or let one expire first"
        ),
    ):
        SMALL.check_sessions_per_key("alice", 2)


LIMIT_ARGS = [
    *("--limit-message-bytes", "2048", "--limit-prompt-tokens", "20"),
    *("--limit-new-tokens", "30", "--limit-stop-sequences", "2", "--limit-stop-chars", "5"),
    *("--limit-beams", "3", "--limit-stream-s", "30", "--limit-sessions-per-key", "2"),
]


def test_the_flags_set_every_limit_and_default_to_the_dataclass():
    parser = argparse.ArgumentParser()
    add_request_limit_flags(parser)
    assert limits_from(parser.parse_args([])) == RequestLimits()
    assert limits_from(parser.parse_args(LIMIT_ARGS)) == SMALL


def test_the_orchestrator_takes_the_limits_from_its_config_file_and_flags(tmp_path):
    path = tmp_path / "orchestrator.yaml"
    path.write_text(
        "checkpoint: c\ntrunk: t\njury: [j]\nredis_url: redis://127.0.0.1:1/0\n"
        "limit_new_tokens: 99\nlimit_stream_s: 30\n"
    )
    unset = argparse.Namespace(**dict.fromkeys(SETTINGS))  # as the orchestrator parses
    args = build_parser().parse_args(["--config", str(path), *LIMIT_ARGS[:4]], unset)
    config = OrchestratorConfig.load(path, {name: getattr(args, name) for name in SETTINGS})
    limits = config.request_limits()
    assert (limits.message_bytes, limits.prompt_tokens) == (2048, 20)  # the flags
    assert (limits.new_tokens, limits.stream_s) == (99, 30.0)  # the file
    assert limits.beams == RequestLimits.beams  # neither


def test_a_bad_limit_stops_either_server_before_it_starts(jury_checkpoint, capsys):
    assert main(["serve", "--checkpoint", str(jury_checkpoint), "--limit-new-tokens", "0"]) == 2
    assert capsys.readouterr().err == (
        "hydra-jury serve: error: --limit-new-tokens must be positive, got 0\n"
    )
    argv = ["orchestrator", "--checkpoint", "c", "--trunk", "t", "--jury", "j"]
    argv += ["--redis-url", "redis://127.0.0.1:1/0", "--limit-stream-s", "-1"]
    assert main(argv) == 2
    assert "--limit-stream-s must be positive, got -1.0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    limits = RequestLimits(message_bytes=2048, new_tokens=60, stream_s=0.001)
    stack = Stack(str(jury_checkpoint), [], redis_url, max_session_tokens=256)
    stack.start_embedded(request_limits=limits)
    yield stack
    stack.close()


def test_the_public_port_refuses_a_message_over_its_limit(stack):
    generation = stack.generation()
    big = request_to_pb(GenerationRequest(prompt="a" * 3000, max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(big, timeout=30)
    assert raised.value.code() == Code.RESOURCE_EXHAUSTED
    assert re.search(r"larger than max \(\d+ vs\. 2048\)", raised.value.details())


def test_a_limit_over_grpc_is_invalid_argument_naming_the_flag(stack):
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(
            request_to_pb(GenerationRequest(prompt="hi", max_new_tokens=61)), timeout=30
        )
    assert raised.value.code() == Code.INVALID_ARGUMENT
    assert "max_new_tokens=61 is over this server's limit of 60 (--limit-new-tokens)" in (
        raised.value.details()
    )


def test_a_generation_past_its_time_stops_and_resumes_to_the_same_tokens(stack, engine):
    options = {"max_new_tokens": 40, "ignore_eos": True, "seed": 7, "gamma": 3}
    expected = engine.generate(GenerationRequest(prompt="time", **options))
    generation = stack.generation()
    session = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    request = request_to_pb(GenerationRequest(prompt="time", **options))
    request.session_id, request.request_id = session.session_id, "long-one"
    stops = 0
    while True:
        try:
            list(generation.GenerateStream(request, timeout=30))
            break
        except grpc.RpcError as error:
            assert error.code() == Code.DEADLINE_EXCEEDED, error.details()
            assert error.details().startswith(
                "the generation's running time in seconds is over this server's limit of "
                "0.001 (--limit-stream-s): the generation stopped after its last committed "
                f"round; send the request again with session_id {session.session_id!r} and "
                "request_id 'long-one' to continue it"
            )
            stops += 1
            assert stops < 60
    assert stops > 1
    final = generation.Generate(request, timeout=30)  # finished: replayed as it is
    assert list(final.token_ids) == expected.token_ids
    assert final.stats.resumed_rounds > 0


def test_a_generation_without_a_request_id_is_told_how_to_resume(stack):
    request = request_to_pb(GenerationRequest(prompt="time", max_new_tokens=40, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(request, timeout=30)
    assert raised.value.code() == Code.DEADLINE_EXCEEDED
    assert raised.value.details().endswith(
        "a request with a request_id can be continued by sending it again"
    )


def test_every_limit_is_a_configuration_key_with_its_default():
    """The configuration spells the limits out as keys: a limit added to `RequestLimits`
    without its key would get a flag that `OrchestratorConfig` cannot take."""
    config = OrchestratorConfig()
    for limit in fields(RequestLimits):
        assert getattr(config, limit_setting(limit.name)) == limit.default, limit.name
