"""The Generation API's log line per generation, as `--log-format json` writes it, on the
single-process server (real servers on loopback, sessions in a real Redis): a finished
gRPC or HTTP generation's line has its ids, token counts, rounds, status OK and
duration and never its prompt or text; a refused one has its status and detail (one
line, not two); a call that fails without a generation has a line of its own; the
trace id is the `traceparent` header's when that is valid, else null."""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.request

import grpc
import pytest

from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving.logs import JsonFormatter
from tests.grpc_stack import Stack, wait_for

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
PROMPT = "the secret prompt"


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [], redis_url, max_session_tokens=128)
    stack.start_embedded(http_listen="127.0.0.1:0", served_model_name="demo")
    yield stack
    stack.close()


@pytest.fixture
def lines():
    """The request lines the server logs while the test runs, parsed (`--log-format json`'s
    formatter on the requests' logger)."""
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("hydra_jury.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def parsed() -> list[dict]:
        return [json.loads(line) for line in written.getvalue().splitlines()]

    yield parsed
    logger.removeHandler(handler)


def request(prompt: str = PROMPT, **options) -> generation_pb2.GenerateRequest:
    options = {"max_new_tokens": 6, "ignore_eos": True, "seed": 3, **options}
    return generation_pb2.GenerateRequest(
        prompt=prompt, request_id="req-1", options=generation_pb2.DecodingOptions(**options)
    )


def test_a_finished_generation_has_its_ids_counts_and_trace(stack, lines):
    metadata = [("traceparent", TRACEPARENT)]
    response = stack.generation().Generate(request(), metadata=metadata, timeout=30)
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert line["level"] == "INFO" and line["logger"] == "hydra_jury.requests"
    assert (line["rpc"], line["status"], line["trace_id"]) == ("Generate", "OK", TRACE)
    assert (line["request_id"], line["session_id"]) == ("req-1", response.session_id)
    assert line["key_name"] is None  # a server without API keys
    assert (line["prompt_tokens"], line["generated_tokens"]) == (response.prompt_tokens, 6)
    assert line["rounds"] == response.stats.rounds > 0
    assert line["duration_s"] > 0 and "detail" not in line
    assert PROMPT not in json.dumps(line) and response.text not in line["message"]


def test_a_stream_with_an_invalid_traceparent_has_no_trace_id(stack, lines):
    metadata = [("traceparent", f"00-{'0' * 32}-00f067aa0ba902b7-01")]
    list(stack.generation().GenerateStream(request(), metadata=metadata, timeout=30))
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert (line["rpc"], line["status"], line["trace_id"]) == ("GenerateStream", "OK", None)


def test_a_refused_generation_is_an_error_line(stack, lines):
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(request(rule="best"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert (line["level"], line["status"]) == ("WARNING", "INVALID_ARGUMENT")
    assert "unknown rule 'best'" in line["detail"] and line["request_id"] == "req-1"
    assert (line["generated_tokens"], line["rounds"], line["prompt_tokens"]) == (0, 0, None)


def test_an_http_completion_has_its_path_and_trace(stack, lines):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "hydra": {"ignore_eos": True}}
    address = stack.servers["orchestrator"].http.address
    call = urllib.request.Request(
        f"http://{address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
    )
    with urllib.request.urlopen(call, timeout=30) as answer:
        completion = json.load(answer)
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert (line["rpc"], line["status"], line["trace_id"]) == ("/v1/completions", "OK", TRACE)
    assert line["generated_tokens"] == completion["usage"]["completion_tokens"] == 4
    assert line["prompt_tokens"] == completion["usage"]["prompt_tokens"]


def test_a_failed_call_without_a_generation_has_a_line_of_its_own(stack, lines):
    close = generation_pb2.CloseSessionRequest(session_id="no-such-session")
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().CloseSession(close, metadata=[("traceparent", TRACEPARENT)], timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert (line["rpc"], line["status"], line["trace_id"]) == ("CloseSession", "NOT_FOUND", TRACE)
    assert "no-such-session" in line["detail"] and line["level"] == "WARNING"


def test_an_http_body_refused_before_any_generation_has_a_line(stack, lines):
    address = stack.servers["orchestrator"].http.address
    call = urllib.request.Request(
        f"http://{address}/v1/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(call, timeout=30)
    assert raised.value.code == 400
    assert wait_for(lambda: len(lines()) == 1)
    [line] = lines()
    assert (line["rpc"], line["status"], line["trace_id"]) == (
        "/v1/completions",
        "INVALID_ARGUMENT",
        TRACE,
    )
    assert "not JSON" in line["detail"]
