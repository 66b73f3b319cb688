"""The OpenAI-compatible HTTP API (`--http-listen`), with the official `openai` client,
on the split stack's orchestrator and on the single-process server (real servers on
loopback, sessions in a real Redis, API keys): chat and text completions equal to the
gRPC API's output for the same seed and repeatable, streaming with usage, n choices,
stop sequences, logprobs, sessions kept across turns, refusals with OpenAI's error
JSON and the right status, a client disconnecting mid-stream freeing the session; and
one server over TLS (HTTPS with the gRPC port's certificate) that drains."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest

from hydra_jury.cli.certs import make_certificates
from hydra_jury.orchestrator.http_api.requests import REQUEST_HEADER, SESSION_HEADER
from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.serving.api_keys import KeyFile
from hydra_jury.serving.auth import ApiKeyAuth, with_api_key
from tests.grpc_stack import Stack, wait_for

KEY = "http-key-0123456789abcdef"
METERED = "metered-key-0123456789ab"  # 3 tokens a minute
KEY_FILE = f"alice:{KEY}\nmetered:{METERED}:tokens_per_minute=3\n"
LIMITS = RequestLimits(message_bytes=64 * 1024, choices=2)
HELLO = [{"role": "user", "content": "Hello there!"}]
# No end of sequence: the random model's answers have the length asked for.
LONG = {"hydra": {"ignore_eos": True}}


@pytest.fixture(
    scope="module",
    params=[[["head0", "head1"], ["head2", "head3"]], "embedded"],
    ids=["two-shards", "single-process"],
)
def stack(request, jury_checkpoint, redis_url, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(KEY_FILE)
    stack = Stack(str(jury_checkpoint), [], redis_url, max_sessions=8, max_session_tokens=256)
    options = {
        "auth": ApiKeyAuth(KeyFile(key_file)),
        "request_limits": LIMITS,
        "http_listen": "127.0.0.1:0",
        "metrics_port": 0,
    }
    if request.param == "embedded":
        stack.start_embedded(**options)
    else:
        stack.shards = request.param
        stack.start_services().start_orchestrator(**options)
    yield stack
    stack.close()


def http_address(stack: Stack) -> str:
    return stack.servers["orchestrator"].http.address


def client(stack: Stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{http_address(stack)}/v1", api_key=key, max_retries=0)


def model(stack: Stack) -> str:
    return client(stack).models.list().data[0].id


def chat(stack: Stack, messages=HELLO, **options):
    return client(stack).chat.completions.create(model=model(stack), messages=messages, **options)


def grpc_generate(stack: Stack, **options) -> generation_pb2.GenerateResponse:
    stub = generation_pb2_grpc.GenerationStub(with_api_key(stack.channel("orchestrator"), KEY))
    return stub.Generate(generation_pb2.GenerateRequest(**options), timeout=30)


def grpc_chat(stack: Stack, **options) -> generation_pb2.GenerateResponse:
    messages = generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(**message) for message in HELLO]
    )
    return grpc_generate(
        stack, messages=messages, options=generation_pb2.DecodingOptions(**options)
    )


def load_record(stack: Stack, session_id: str):
    """The record of alice's session `session_id`, as Redis holds it."""

    async def read():
        store = stack.store()
        try:
            return await store.load(session_id, "alice")
        finally:
            await store.close()

    return stack.loop.run(read())


def refusal(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def counter(stack: Stack, name: str, **labels: str) -> float:
    """The server's counter `hydrajury_NAME_total` (with `labels`)."""
    registry = stack.servicer.metrics.registry
    return registry.get_sample_value(f"hydrajury_{name}_total", labels) or 0


def test_models_and_health(stack, jury_checkpoint):
    (served,) = client(stack).models.list().data
    assert served.id == jury_checkpoint.name and served.owned_by == "hydra-jury"
    assert served.model_extra["hydra"]["heads"] == ["head0", "head1", "head2", "head3"]
    with urllib.request.urlopen(f"http://{http_address(stack)}/health", timeout=5) as answer:
        assert json.load(answer) == {"status": "SERVING"}


def test_chat_and_completion_equal_the_grpc_output_and_repeat_with_their_seed(stack):
    options = {"max_tokens": 8, "temperature": 0.9, "seed": 11}
    first, second = chat(stack, **options), chat(stack, **options)
    reference = grpc_chat(stack, max_new_tokens=8, temperature=0.9, seed=11)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.content == reference.text
    assert (
        first.choices[0].finish_reason
        == {"eos": "stop", "length": "length"}[reference.finish_reason]
    )
    assert first.usage.completion_tokens == len(reference.token_ids)
    assert first.usage.prompt_tokens == reference.prompt_tokens
    assert first.choices[0].model_extra["hydra"]["seed"] == 11
    assert chat(stack, max_tokens=8, temperature=0.9, seed=12).choices[0].message.content != (
        reference.text
    )

    text = client(stack).completions.create(
        model=model(stack), prompt="Once upon a time", max_tokens=6, temperature=0, seed=3
    )
    plain = grpc_generate(
        stack,
        prompt="Once upon a time",
        options=generation_pb2.DecodingOptions(max_new_tokens=6, temperature=0, seed=3),
    )
    assert text.choices[0].text == plain.text and text.object == "text_completion"


def test_streaming_with_usage(stack):
    options = {"max_tokens": 8, "temperature": 0.8, "seed": 5, "extra_body": LONG}
    whole = chat(stack, **options)
    chunks = list(chat(stack, stream=True, stream_options={"include_usage": True}, **options))
    *rounds, last = chunks
    assert rounds[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in rounds) == whole.choices[0].message.content
    assert rounds[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in rounds) and not last.choices
    assert last.usage.completion_tokens == 8 == whole.usage.completion_tokens
    assert rounds[-1].choices[0].model_extra["hydra"]["stats"]["emitted"] == 8

    pieces = client(stack).completions.create(
        model=model(stack), prompt="Once", stream=True, **options
    )
    assert len("".join(piece.choices[0].text for piece in pieces)) > 0


def test_n_choices_each_with_its_seed(stack):
    both = chat(stack, n=2, max_tokens=6, temperature=1.0, seed=21, extra_body=LONG)
    alone = [
        chat(stack, max_tokens=6, temperature=1.0, seed=seed, extra_body=LONG) for seed in (21, 22)
    ]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.message.content for c in both.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert both.usage.completion_tokens == 12
    assert refusal(lambda: chat(stack, n=3)).status_code == 400  # LIMITS.choices


def test_stop_sequences(stack):
    greedy = chat(stack, max_tokens=12, temperature=0, extra_body=LONG).choices[0]
    text = greedy.message.content
    stop = text[3:5]
    stopped = chat(stack, max_tokens=12, temperature=0, stop=stop, extra_body=LONG).choices[0]
    assert stopped.message.content == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["hydra"]["finish_reason"] == "stop"


def test_logprobs(stack):
    answer = chat(stack, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3).choices[0]
    tokens = answer.logprobs.content
    assert "".join(t.token for t in tokens) == answer.message.content
    for token in tokens:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        # Greedy: each token is the likeliest under the target.
        assert (token.top_logprobs[0].token, token.top_logprobs[0].logprob) == (
            token.token,
            token.logprob,
        )
    assert chat(stack, max_tokens=2).choices[0].logprobs is None

    text = client(stack).completions.create(
        model=model(stack), prompt="Once", max_tokens=4, temperature=0, logprobs=2, extra_body=LONG
    )
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_a_session_kept_across_turns(stack):
    api = client(stack)
    first = api.chat.completions.with_raw_response.create(
        model=model(stack),
        messages=HELLO,
        max_tokens=4,
        extra_body={"hydra": {"keep_session": True}},
    )
    session = first.headers[SESSION_HEADER]
    assert (
        first.headers[REQUEST_HEADER]
        and first.parse().choices[0].model_extra["hydra"]["session_id"] == session
    )
    second = api.chat.completions.create(
        model=model(stack),
        messages=[{"role": "user", "content": "And then?"}],
        max_tokens=4,
        extra_headers={SESSION_HEADER: session},
    )
    assert second.choices[0].model_extra["hydra"]["stats"]["reused_tokens"] > 0
    record = load_record(stack, session)
    assert [m["role"] for m in record.messages] == ["user", "assistant", "user", "assistant"]
    missing = refusal(
        lambda: chat(stack, max_tokens=2, extra_headers={SESSION_HEADER: "no-such-session"})
    )
    assert missing.status_code == 404 and missing.body["code"] == "not_found"


def test_refusals_are_openai_errors_with_their_status(stack):
    def error_of(call, status: int) -> dict:
        error = refusal(call)
        assert error.status_code == status, error
        return error.body

    unauthenticated = error_of(lambda: client(stack, "wrong-key-0123456789").models.list(), 401)
    assert unauthenticated["code"] == "invalid_api_key"
    assert unauthenticated["message"] == "the API key is not valid on this server"
    request = urllib.request.Request(f"http://{http_address(stack)}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=5)
    assert missing.value.code == 401 and missing.value.headers["WWW-Authenticate"] == "Bearer"
    assert "send the header 'Authorization: Bearer <key>'" in missing.value.read().decode()

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    refused = error_of(lambda: chat(stack, tools=tools), 400)
    assert refused["param"] == "tools" and refused["code"] == "unsupported_parameter"
    assert error_of(lambda: chat(stack, extra_body={"best_of": 2}), 400)["code"] == (
        "unknown_parameter"
    )
    assert (
        "unknown rule 'nope'"
        in error_of(lambda: chat(stack, extra_body={"hydra": {"rule": "nope"}}), 400)["message"]
    )
    for extension, param in (
        ({"temperature": 1}, "temperature"),
        ({"keep_session": 1}, "keep_session"),
    ):
        body = {"hydra": extension}
        assert error_of(lambda body=body: chat(stack, extra_body=body), 400)["param"] == (
            f"hydra.{param}"
        )
    for path, status in (("/v1/embeddings", 404), ("/v1/chat/completions", 405)):
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://{http_address(stack)}{path}", timeout=5)
        assert answer.value.code == status
        assert json.load(answer.value)["error"]["message"].startswith(f"GET {path}: ")
    wrong_model = client(stack).chat.completions.create
    assert error_of(lambda: wrong_model(model="gpt-4o", messages=HELLO), 404)["code"] == (
        "model_not_found"
    )
    huge = [{"role": "user", "content": "x" * LIMITS.message_bytes}]
    assert "--limit-message-bytes" in error_of(lambda: chat(stack, messages=huge), 413)["message"]

    metered = client(stack, METERED)
    metered.chat.completions.create(
        model=model(stack), messages=HELLO, max_tokens=4, extra_body=LONG
    )
    limited = error_of(
        lambda: metered.chat.completions.create(model=model(stack), messages=HELLO), 429
    )
    assert "API key 'metered' generated 4 tokens in the last minute" in limited["message"]


def test_a_disconnect_cancels_the_generation_and_frees_the_session(stack):
    # A kept session: its lease comes back, the next turn runs on it.
    options = {"max_tokens": 200, "temperature": 0, "extra_body": LONG}
    api = client(stack)
    kept = {"hydra": {"ignore_eos": True, "keep_session": True}}
    with api.chat.completions.with_streaming_response.create(
        model=model(stack), messages=HELLO, stream=True, **{**options, "extra_body": kept}
    ) as response:
        session = response.headers[SESSION_HEADER]
        next(iter(response.parse()))
    following = retry_busy(
        lambda: chat(stack, max_tokens=2, extra_headers={SESSION_HEADER: session})
    )
    assert following.choices[0].message.content
    assert len(load_record(stack, session).tokens) < 200  # the first turn stopped early

    # A session made for the request alone is closed, streamed or not.
    closed = counter(stack, "session_events", event="closed")
    emitted = counter(stack, "tokens_emitted")
    with api.chat.completions.with_streaming_response.create(
        model=model(stack), messages=HELLO, stream=True, **options
    ) as response:
        next(iter(response.parse()))
    # A client gone before its whole answer: sent, then closed once generation began.
    connection = http.client.HTTPConnection(*http_address(stack).split(":"))
    body = {"model": model(stack), "messages": HELLO, "max_tokens": 200, **LONG}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    began = counter(stack, "tokens_emitted")
    connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    assert wait_for(lambda: counter(stack, "tokens_emitted") > began, 30)
    connection.close()
    assert wait_for(lambda: counter(stack, "session_events", event="closed") == closed + 2)
    assert counter(stack, "tokens_emitted") - emitted < 200  # both stopped early


def retry_busy(call, attempts: int = 100):
    """`call()`, again while the session is busy (a cancelled generation ending its round)."""
    for _ in range(attempts - 1):
        try:
            return call()
        except openai.ConflictError:
            wait_for(lambda: False, 0.05)
    return call()


@pytest.fixture
def tls_server(jury_checkpoint, redis_url, tmp_path):
    certificates = make_certificates(tmp_path / "certs")
    stack = Stack(str(jury_checkpoint), [], redis_url, tls=certificates)
    stack.start_embedded(
        http_listen="127.0.0.1:0",
        tls=stack.server_tls(mutual=False),
        served_model_name="demo",
    )
    yield stack
    stack.close()


def test_https_with_the_grpc_ports_certificate_and_a_drain(tls_server):
    port = tls_server.servers["orchestrator"].http.address.rsplit(":", 1)[1]
    http_client = openai.DefaultHttpxClient(verify=str(tls_server.tls.ca))
    api = openai.OpenAI(
        base_url=f"https://localhost:{port}/v1",
        api_key="unused",
        max_retries=0,
        http_client=http_client,
    )
    name = api.models.list().data[0].id
    assert name == "demo"  # --served-model-name, not the checkpoint's folder name
    assert api.chat.completions.create(model=name, messages=HELLO, max_tokens=2).choices
    plaintext = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        plaintext.models.list()

    tls_server.loop.run(tls_server.servicer.drain(0))
    draining = refusal(lambda: api.chat.completions.create(model=name, messages=HELLO))
    assert draining.status_code == 503 and "draining" in draining.body["message"]
    health = http_client.get(f"https://localhost:{port}/health")
    assert health.status_code == 503 and health.json() == {"status": "NOT_SERVING"}


def test_an_http_address_in_use_stops_the_start_naming_the_flag(jury_checkpoint, redis_url):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        stack = Stack(str(jury_checkpoint), [], redis_url)
        try:
            with pytest.raises(OSError, match=f"--http-listen: cannot bind {address}: "):
                stack.start_embedded(http_listen=address)
            assert not stack.servers
        finally:
            stack.close()
