"""The command-line clients on sessions: `hydra-jury chat` (the `Chat` loop) and
`hydra-jury generate --session / --request-id / --local`, over a real single-process
server with its sessions in a real Redis."""

from __future__ import annotations

import io
import json
import re
import sys
import threading
from dataclasses import replace

import grpc
import pytest

from hydra_jury.cli import generate, main
from hydra_jury.orchestrator.chat import Chat, metrics_lines
from hydra_jury.orchestrator.client import GenerationClient
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from tests.grpc_stack import Stack

# Greedy and a fixed length: every answer is the same however often it is asked.
# A fixed drafter: the automatic mode's choices follow live timings, and with them the
# rounding of near ties — the chat's answers are compared with the API's exactly.
OPTIONS = GenerationRequest(
    max_new_tokens=6, ignore_eos=True, temperature=0.0, seed=3, drafter="head"
)
DECODING_FLAGS = [
    *("--max-new-tokens", "4", "--ignore-eos", "--temperature", "0", "--seed", "1"),
    *("--drafter", "head"),
]
SYSTEM = "Answer briefly."


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [], redis_url).start_embedded()
    yield stack
    stack.close()


@pytest.fixture
def client(stack):
    with GenerationClient(stack.addresses["orchestrator"]) as client:
        yield client


def stream_turn(stub, messages: list[dict[str, str]], session_id: str = ""):
    """One turn by the API itself: (text, tokens, stats, session id)."""
    request = request_to_pb(replace(OPTIONS, messages=messages), session_id)
    text, tokens, last = "", [], None
    for message in stub.GenerateStream(request, timeout=30):
        text += message.text
        tokens.extend(message.tokens)
        last = message
    return text, tokens, last.stats, last.session_id


def close(stub, session_id: str) -> None:
    stub.CloseSession(generation_pb2.CloseSessionRequest(session_id=session_id), timeout=5)


def test_chat_keeps_one_session_across_turns_until_reset(stack, client):
    stub = stack.generation()
    stdin = io.StringIO("hello\nand more\n/metrics\n/session\n/reset\nagain\n/quit\nunread\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    chat = Chat(client, OPTIONS, stdin=stdin, stdout=stdout, stderr=stderr, system=SYSTEM)
    assert chat.run() == 0

    # The same turns sent through the API: the chat printed exactly their answers.
    first, _, _, session_id = stream_turn(
        stub, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    )
    second, tokens, stats, _ = stream_turn(
        stub, [{"role": "user", "content": "and more"}], session_id
    )
    third, _, _, other_id = stream_turn(
        stub, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "again"}]
    )
    close(stub, session_id)
    close(stub, other_id)
    assert stats.reused_tokens > 0  # the second turn continued the first's caches
    metrics = metrics_lines(tokens, stats)
    assert len(metrics) == 1 + OPTIONS.max_new_tokens + 1  # header, tokens, statistics
    assert f"reused {stats.reused_tokens}" in metrics[-1]

    output = stdout.getvalue()
    head = f"{first}\n{second}\n" + "".join(f"{line}\n" for line in metrics)
    assert output.startswith(head)
    closed_id, rest = output[len(head) :].split("\n", 1)
    assert rest == f"{third}\n"  # nothing read after /quit

    # /reset closed the first session; the chat ends on the second, left open.
    assert re.fullmatch(r"[0-9a-f]{32}", closed_id) and chat.session_id != closed_id
    request = request_to_pb(replace(OPTIONS, messages=[{"role": "user", "content": "x"}]))
    request.session_id = closed_id
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert stderr.getvalue().endswith(f"session: {chat.session_id}\n")
    close(stub, chat.session_id)


def test_a_failed_turn_is_reported_and_the_chat_goes_on(stack, client):
    stub = stack.generation()
    stdin = io.StringIO("/metrics\nhi\n/bogus\nagain\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    # A session that does not exist: the first turn fails, the next starts a new one.
    chat = Chat(client, OPTIONS, stdin=stdin, stdout=stdout, stderr=stderr, session_id="gone")
    assert chat.run() == 0
    errors = stderr.getvalue()
    assert "no answer yet" in errors
    assert "error: NOT_FOUND: " in errors and "the next message starts a new one" in errors
    assert "unknown command /bogus" in errors
    answer, _, _, session_id = stream_turn(stub, [{"role": "user", "content": "again"}])
    close(stub, session_id)
    assert stdout.getvalue() == f"{answer}\n"
    close(stub, chat.session_id)


def test_the_chat_command_talks_to_a_server(stack, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/session\n"))
    assert main(["chat", "--address", stack.addresses["orchestrator"], *DECODING_FLAGS]) == 0
    captured = capsys.readouterr()
    session_id = re.fullmatch(r"session: (\w+)\n", captured.err)[1]
    assert captured.out.endswith(f"\n{session_id}\n")
    close(stack.generation(), session_id)


def test_the_chat_command_needs_a_server_it_can_reach(monkeypatch, capsys):
    monkeypatch.setattr(generate, "CONNECT_TIMEOUT_S", 0.2)
    assert main(["chat", "--address", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("hydra-jury chat: error: cannot reach 127.0.0.1:1")


def test_generate_continues_a_session(stack, capsys):
    argv = ["generate", "--address", stack.addresses["orchestrator"], *DECODING_FLAGS]
    assert main([*argv, "hello"]) == 0
    session_id = re.fullmatch(r"session: (\w+)\n", capsys.readouterr().err)[1]

    continued = [*argv, "--session", session_id, "--request-id", "turn-2", "--json", "more"]
    assert main(continued) == 0
    response = json.loads(capsys.readouterr().out)
    assert response["sessionId"] == session_id and response["stats"]["reusedTokens"] > 0
    # The same request id again: its stored result, not a third turn.
    assert main(continued) == 0
    assert json.loads(capsys.readouterr().out) == response
    close(stack.generation(), session_id)

    assert main([*argv, "--session", session_id, "gone"]) == 2
    assert "hydra-jury generate: error: NOT_FOUND: " in capsys.readouterr().err


def test_generate_local_runs_on_an_in_memory_session(jury_checkpoint, engine, capsys):
    argv = ["generate", "--local", "--checkpoint", str(jury_checkpoint), "hi"]
    argv += ["--max-new-tokens", "8", "--seed", "5"]
    expected = engine.generate(
        GenerationRequest(messages=[{"role": "user", "content": "hi"}], max_new_tokens=8, seed=5)
    )
    assert main([*argv, "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["token_ids"] == expected.token_ids and output["session"]
    assert main(argv) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    assert main([*argv, "--session", "abc"]) == 2
    assert "--session and --request-id need --address" in capsys.readouterr().err


def test_generate_local_loads_and_computes_on_one_model_thread(
    jury_checkpoint, engine, capsys, monkeypatch
):
    """Torch's parallel work on a second thread would start a second OpenMP team, and
    libgomp would then wake its threads for every parallel region: the model is loaded,
    and every model call runs, on the model thread alone."""
    threads: list[tuple[str, str]] = []

    class Recorded(generate.LocalBackend):
        def draft(self, call):
            threads.append(("draft", threading.current_thread().name))
            return super().draft(call)

        def score(self, call):
            threads.append(("score", threading.current_thread().name))
            return super().score(call)

    load = generate.HydraModel.load

    def recorded_load(*args, **kwargs):
        threads.append(("load", threading.current_thread().name))
        return load(*args, **kwargs)

    monkeypatch.setattr(generate, "LocalBackend", Recorded)
    monkeypatch.setattr(generate.HydraModel, "load", recorded_load)
    argv = ["generate", "--local", "--checkpoint", str(jury_checkpoint), "hi", "--json"]
    assert main([*argv, "--max-new-tokens", "6", "--seed", "5", "--rule", "verifier_only"]) == 0
    expected = engine.generate(
        GenerationRequest(
            messages=[{"role": "user", "content": "hi"}],
            max_new_tokens=6,
            seed=5,
            rule="verifier_only",
        )
    )
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected.token_ids
    assert {kind for kind, _ in threads} == {"load", "draft", "score"}
    assert all(name.startswith("model") for _, name in threads), threads
