"""Client authentication on the Generation API, on the single-process server and the
split stack's orchestrator (real gRPC servers, sessions in a real Redis): calls without a
valid key are UNAUTHENTICATED, a hashed key works, a key revoked by rewriting the file
is refused, a session is its key's alone (another key gets NOT_FOUND, as for a missing
session), per-key limits refuse with RESOURCE_EXHAUSTED and a retry hint, and metrics
and logs name keys, never show them."""

from __future__ import annotations

import hashlib
import io
import logging
import re
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydra_jury.cli import main
from hydra_jury.orchestrator.metrics import OrchestratorMetrics
from hydra_jury.orchestrator.server import _auth_interceptors
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.serving.api_keys import KeyFile
from hydra_jury.serving.auth import ApiKeyAuth, with_api_key
from tests.grpc_stack import Stack, wait_for

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"  # in the file as its SHA-256 only
SINGLE = "single-key-0123456789abcd"  # one generation at a time
METERED = "metered-key-0123456789abc"  # 5 tokens a minute
TEMPORARY = "temporary-key-0123456789a"
REPLAYER = "replayer-key-0123456789ab"  # 10 tokens a minute
KEYS = [ALICE, BOB, SINGLE, METERED, TEMPORARY, REPLAYER]
KEY_FILE = f"""# the test's keys
alice:{ALICE}
bob:sha256:{hashlib.sha256(BOB.encode()).hexdigest()}
single:{SINGLE}:max_concurrent=1
metered:{METERED}:tokens_per_minute=5
replayer:{REPLAYER}:tokens_per_minute=10
"""


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def logs():
    """Every line the servers log while the module's tests run."""
    captured, logger = Captured(), logging.getLogger("hydra_jury")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(captured)
    yield captured
    logger.removeHandler(captured)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    return tmp_path_factory.mktemp("keys") / "api-keys"


@pytest.fixture(
    scope="module",
    params=[[["head0", "head1"], ["head2", "head3"]], "embedded"],
    ids=["two-shards", "single-process"],
)
def stack(request, jury_checkpoint, redis_url, key_file, logs):
    key_file.write_text(KEY_FILE)
    logs.lines.clear()
    stack = Stack(str(jury_checkpoint), [], redis_url, max_sessions=8, max_session_tokens=256)
    auth = ApiKeyAuth(KeyFile(key_file, poll_s=0.05))
    if request.param == "embedded":
        stack.start_embedded(auth=auth, metrics_port=0)
    else:
        stack.shards = request.param
        stack.start_services().start_orchestrator(auth=auth, metrics_port=0)
    yield stack
    stack.close()


def load_record(stack: Stack, session_id: str, key_name: str):
    """The session's record as Redis holds it among the sessions of `key_name`."""

    async def read():
        store = stack.store()
        try:
            return await store.load(session_id, key_name)
        finally:
            await store.close()

    return stack.loop.run(read())


def generation(stack: Stack, key: str | None) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(with_api_key(stack.channel("orchestrator"), key))


def chat(text: str, session_id: str = "", request_id: str = "", **options):
    options = {"max_new_tokens": 4, "seed": 5, "temperature": 0.0, **options}
    return generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=text)]
        ),
        session_id=session_id,
        request_id=request_id,
        options=generation_pb2.DecodingOptions(**options),
    )


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def every_rpc(stub: generation_pb2_grpc.GenerationStub) -> dict:
    return {
        "Info": lambda: stub.Info(generation_pb2.GenerationInfoRequest(), timeout=5),
        "Generate": lambda: stub.Generate(chat("hi"), timeout=30),
        "GenerateStream": lambda: list(stub.GenerateStream(chat("hi"), timeout=30)),
        "CreateSession": lambda: stub.CreateSession(
            generation_pb2.CreateSessionRequest(), timeout=5
        ),
        "CloseSession": lambda: stub.CloseSession(
            generation_pb2.CloseSessionRequest(session_id="abc"), timeout=5
        ),
    }


def test_every_rpc_needs_a_valid_key_and_health_stays_open(stack):
    for key, detail in (
        (None, "this server requires an API key: send the metadata 'authorization: Bearer"),
        ("wrong-key-0123456789abcdef", "the API key is not valid on this server"),
        (ALICE[:-1], "the API key is not valid on this server"),
    ):
        for rpc, call in every_rpc(generation(stack, key)).items():
            error = refusal(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, error.details())
            assert error.details().startswith(detail), (rpc, error.details())
    health = health_pb2_grpc.HealthStub(stack.channel("orchestrator"))
    for service in ("", "hydrajury.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    answer = generation(stack, ALICE).Generate(chat("hi"), timeout=30)
    assert len(answer.token_ids) == 4


def test_a_hashed_key_works(stack):
    stub = generation(stack, BOB)
    assert stub.Info(generation_pb2.GenerationInfoRequest(), timeout=5).heads
    assert list(stub.GenerateStream(chat("hi"), timeout=30))[-1].finish_reason


def test_a_session_is_its_keys_alone(stack):
    alice, bob = generation(stack, ALICE), generation(stack, BOB)
    first = alice.Generate(chat("hello", request_id="alice-1"), timeout=30)
    session = first.session_id
    missing = refusal(lambda: bob.Generate(chat("x", session_id="no-such-session"), timeout=30))
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    # Another key gets what a missing session gets, whatever it tries.
    for call in (
        lambda: bob.Generate(chat("mine now", session_id=session), timeout=30),
        lambda: list(bob.GenerateStream(chat("mine now", session_id=session), timeout=30)),
        lambda: bob.Generate(chat("hello", session_id=session, request_id="alice-1"), timeout=30),
        lambda: bob.CloseSession(generation_pb2.CloseSessionRequest(session_id=session), timeout=5),
    ):
        error = refusal(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert error.details() == missing.details().replace("no-such-session", session)
    # A chosen id is per key: bob's "shared" is not alice's, and neither learns of the other.
    for stub in (alice, bob):
        request = generation_pb2.CreateSessionRequest(session_id="shared")
        made = stub.CreateSession(request, timeout=5)
        assert made.session_id == "shared"
    bob.CloseSession(generation_pb2.CloseSessionRequest(session_id="shared"), timeout=5)
    alice.Generate(chat("still mine", session_id="shared"), timeout=30)
    # Alice's session is untouched: her request replays, her next turn continues it.
    again = alice.Generate(chat("hello", session_id=session, request_id="alice-1"), timeout=30)
    assert again == first
    turn = alice.Generate(chat("and then?", session_id=session), timeout=30)
    assert turn.stats.reused_tokens > 0
    record = load_record(stack, session, "alice")
    assert record.key_name == "alice" and record.session_id == session
    assert load_record(stack, session, "bob") is None
    assert load_record(stack, session, "") is None


def test_a_key_removed_from_the_file_is_refused(stack, key_file):
    stub = generation(stack, TEMPORARY)
    info = generation_pb2.GenerationInfoRequest()

    def accepted() -> bool:
        try:
            stub.Info(info, timeout=5)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            return False
        return True

    key_file.write_text(f"{KEY_FILE}temporary:{TEMPORARY}\n")
    assert wait_for(accepted, timeout=5)
    key_file.write_text(KEY_FILE)
    assert wait_for(lambda: not accepted(), timeout=5)
    assert generation(stack, ALICE).Info(info, timeout=5).heads  # the others still work


def test_a_key_past_its_concurrent_generations_is_refused(stack):
    stub = generation(stack, SINGLE)
    long = chat("count", max_new_tokens=200, ignore_eos=True, temperature=0.9, gamma=1)
    stream = stub.GenerateStream(long, timeout=60)
    first = next(stream)
    error = refusal(lambda: stub.Generate(chat("meanwhile"), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        "API key 'single' has 1 generations in progress, its limit; retry when one of them ends"
    )
    assert generation(stack, ALICE).Generate(chat("meanwhile"), timeout=30).token_ids
    rest = list(stream)  # the first generation is not disturbed
    assert len(first.tokens) + sum(len(m.tokens) for m in rest) == 200
    assert stub.Generate(chat("now"), timeout=30).token_ids  # its slot came back


def test_a_key_past_its_tokens_per_minute_is_refused_with_a_retry_hint(stack):
    stub = generation(stack, METERED)
    answer = stub.Generate(chat("hi", max_new_tokens=6, ignore_eos=True), timeout=30)
    assert len(answer.token_ids) == 6
    error = refusal(lambda: stub.Generate(chat("more"), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(
        r"API key 'metered' generated 6 tokens in the last minute \(its limit is 5\); "
        r"retry in about \d+\.\d s",
        error.details(),
    ), error.details()
    health = health_pb2_grpc.HealthStub(stack.channel("orchestrator"))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1  # SERVING
    assert generation(stack, BOB).Generate(chat("others go on"), timeout=30).token_ids


def test_a_replayed_answer_costs_its_key_nothing(stack):
    stub = generation(stack, REPLAYER)
    first = stub.Generate(chat("hi", request_id="replayed-1", max_new_tokens=6), timeout=30)
    again = chat("hi", session_id=first.session_id, request_id="replayed-1", max_new_tokens=6)
    assert stub.Generate(again, timeout=30) == first
    # 6 of its 10 tokens a minute: the replay, charged again, would have made it 12.
    more = stub.Generate(chat("more", max_new_tokens=4, ignore_eos=True), timeout=30)
    assert len(more.token_ids) == 4


def test_metrics_and_logs_name_keys_and_never_show_them(stack, logs):
    generation(stack, ALICE).Generate(chat("counted"), timeout=30)
    info = generation_pb2.GenerationInfoRequest()
    refusal(lambda: generation(stack, None).Info(info, timeout=5))
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for sample in (
        'hydrajury_key_requests_total{key="alice",rpc="Generate"}',
        'hydrajury_key_tokens_total{key="alice"}',
        'hydrajury_unauthenticated_total{reason="missing"}',
        'hydrajury_errors_total{code="UNAUTHENTICATED"}',
    ):
        assert sample in text, sample
    logged = "\n".join(logs.lines)
    assert "the Generation API requires an API key: 5 keys from" in logged
    assert "Info failed UNAUTHENTICATED: this server requires an API key" in logged
    assert "(alice, bob, single, metered, replayer)" in logged
    assert "reloaded" in logged and "added temporary" in logged  # the revocation test's
    for key in KEYS:
        assert key not in text and key not in logged
        assert hashlib.sha256(key.encode()).hexdigest() not in text + logged


def test_an_open_server_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="hydra_jury"):
        assert _auth_interceptors(None, OrchestratorMetrics()) == []
    assert "no --api-keys: the Generation API is open to any client" in caplog.text


def test_the_clients_send_their_key(stack, monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_JURY_API_KEY", raising=False)
    argv = ["generate", "--address", stack.addresses["orchestrator"], "--max-new-tokens", "3"]
    assert main([*argv, "hi"]) == 2
    assert "error: UNAUTHENTICATED: this server requires an API key" in capsys.readouterr().err
    assert main([*argv, "--api-key", ALICE, "hi"]) == 0
    assert capsys.readouterr().err.startswith("session: ")
    monkeypatch.setenv("HYDRA_JURY_API_KEY", BOB)
    assert main([*argv, "hi"]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/session\n"))
    chat_argv = ["chat", "--address", stack.addresses["orchestrator"], "--max-new-tokens", "3"]
    assert main([*chat_argv, "--api-key", SINGLE]) == 0
    assert "error" not in capsys.readouterr().err
    assert main(["generate", "--local", "--api-key", ALICE, "hi"]) == 2
    assert "--api-key is for a server's API (--address)" in capsys.readouterr().err


def test_a_cancelled_stream_gives_its_keys_slot_back(stack):
    stub = generation(stack, SINGLE)
    stream = stub.GenerateStream(chat("long", max_new_tokens=100, ignore_eos=True), timeout=60)
    next(stream)
    stream.cancel()
    assert wait_for(lambda: _admitted(stub), timeout=10)


def _admitted(stub) -> bool:
    try:
        stub.Generate(chat("next"), timeout=30)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(0.05)
        return False
    return True
