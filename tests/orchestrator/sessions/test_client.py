"""The Python client (`orchestrator.client`) against real servers: a stream whose
orchestrator is killed (SIGKILL) mid-generation goes on, on the other orchestrator
sharing Redis, with the tokens and text of an uninterrupted run of the same seed; a
resent stream starts with every round committed before it; the CLI fails over to the
next address; a resumed stream with a gap is refused."""

from __future__ import annotations

import signal

import grpc
import pytest

from hydra_jury.cli import main
from hydra_jury.orchestrator.client import GenerationClient, ResumeError, RetryPolicy, StreamJoiner
from hydra_jury.orchestrator.sessions.redis_server import free_port
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from tests.grpc_stack import retry_busy
from tests.orchestrator.sessions.test_failover import LONG, orchestrator_process, start_stack
from tests.orchestrator.sessions.test_sessions_api import GREEDY, SAMPLED, chat, user

FAST_RETRIES = RetryPolicy(attempts=8, backoff_s=0.05, max_backoff_s=0.5)


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = start_stack(jury_checkpoint, redis_url)
    yield stack
    stack.close()


def joined(messages) -> tuple[list[int], str]:
    """The token ids and text of a stream's messages, put together."""
    ids, text = [], ""
    for message in messages:
        ids += [token.token_id for token in message.tokens]
        text += message.text
    return ids, text


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_stream_goes_on_when_its_orchestrator_is_killed(stack, options):
    options = {**options, **LONG}
    reference = stack.generation().Generate(chat([user("go on")], **options), timeout=60)
    survivor = stack.addresses["orchestrator"]
    with (
        orchestrator_process(stack) as doomed,
        GenerationClient([doomed.address, survivor], retry=FAST_RETRIES, timeout_s=60) as client,
    ):
        stream = client.generate_stream(chat([user("go on")], **options))
        received = [next(stream) for _ in range(3)]
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait()
        received += list(stream)
        assert client.resumed >= 1  # it really was cut and sent again
    ids, text = joined(received)
    assert ids == list(reference.token_ids)
    assert text == reference.text
    positions = [token.position for message in received for token in message.tokens]
    assert positions == list(range(positions[0], positions[0] + len(positions)))
    assert received[-1].finish_reason == reference.finish_reason


def test_a_resent_stream_starts_with_the_rounds_committed_before(stack):
    generation = stack.generation()
    options = {**SAMPLED, **LONG}
    reference = generation.Generate(chat([user("again")], **options), timeout=60)
    session = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    request = chat([user("again")], session_id=session.session_id, request_id="r-1", **options)
    broken = generation.GenerateStream(request, timeout=60)
    before = [next(broken), next(broken)]
    broken.cancel()
    resent = retry_busy(lambda: list(generation.GenerateStream(request, timeout=60)))
    # The first message holds every round committed before, from the first token on;
    # the server may have committed more than the broken stream delivered.
    caught_up = resent[0]
    assert caught_up.tokens[0].position == before[0].tokens[0].position
    assert len(caught_up.tokens) >= sum(len(message.tokens) for message in before)
    assert caught_up.text.startswith("".join(message.text for message in before))
    assert joined(resent) == (list(reference.token_ids), reference.text)


def test_a_resumed_stream_with_a_gap_is_refused():
    joiner = StreamJoiner()

    def message(text: str, *positions: int) -> generation_pb2.GenerateStreamResponse:
        tokens = [generation_pb2.TokenInfo(token_id=7, position=p) for p in positions]
        return generation_pb2.GenerateStreamResponse(tokens=tokens, text=text)

    joiner.first_of_attempt(message("ab", 10, 11))
    # A resent stream that covers the generation from its start is cut to what is new.
    assert joiner.first_of_attempt(message("abc", 10, 11, 12)).text == "c"
    with pytest.raises(ResumeError, match="skips from position 12 to 14"):
        joiner.first_of_attempt(message("abcd", 14))
    with pytest.raises(ResumeError, match="text does not continue"):
        joiner.first_of_attempt(message("d", 13))


def test_generate_fails_over_to_the_next_address(stack, capsys):
    dead = f"127.0.0.1:{free_port()}"
    addresses = f"{dead},{stack.addresses['orchestrator']}"
    flags = ["--max-new-tokens", "5", "--temperature", "0", "--seed", "1", "--json"]
    assert main(["generate", "--address", addresses, *flags, "hello"]) == 0
    assert '"finishReason"' in capsys.readouterr().out


def test_a_refusal_is_not_retried(stack):
    with GenerationClient(stack.addresses["orchestrator"], retry=FAST_RETRIES) as client:
        request = chat([user("hi")], session_id="no-such-session")
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(request)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.resumed == 0
