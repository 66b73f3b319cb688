"""Fuzzing every RPC of every service — the public Generation API, the internal Trunk and
Jury services — with hypothesis, over a real split stack on loopback: random messages
(huge and negative numbers, lying tensor shapes, any text), valid messages mutated,
invalid UTF-8 in string fields and random bytes as a message. No input is INTERNAL or
UNKNOWN (a bug) or runs into the deadline (a hang); afterwards every server is healthy
and a canary session, made before, generates the same tokens as then. The tensor codec
and the session record decoder get the same treatment without a server.

`make test` runs a few examples per RPC (`HYDRA_JURY_FUZZ_EXAMPLES`, 6); `make fuzz`
(`python -m tools.fuzz`) runs many more."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hydra_jury.orchestrator.sessions.record import SessionRecord
from hydra_jury.protos.codec import WIRE_DTYPES, CodecError, tensor_from_pb, tensor_to_pb
from hydra_jury.protos.hydrajury.v1 import generation_pb2, internal_pb2, tensor_pb2
from tests.grpc_stack import Stack
from tests.orchestrator.sessions.test_sessions_api import chat, user
from tests.worker_services import (
    draft_request,
    jury_prefill_request,
    prefill_request,
    score_request,
)

EXAMPLES_VARIABLE = "HYDRA_JURY_FUZZ_EXAMPLES"
EXAMPLES = int(os.environ.get(EXAMPLES_VARIABLE, "6"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a call's time is bounded by CALL_TIMEOUT_S instead
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,  # no .hypothesis/ folder left in the checkout
)
CALL_TIMEOUT_S = 20.0  # a call still running then is a hang
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
INT_BOUNDS = {
    descriptor.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    descriptor.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
CANARY = {"max_new_tokens": 8, "temperature": 0.9, "seed": 5, "ignore_eos": True}


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Small numbers mostly (those reach the deep code), and the extremes."""
    return st.one_of(
        st.integers(-2, 40), st.sampled_from([low, high, -1, 2**31 - 1]), st.integers(low, high)
    ).filter(lambda value: low <= value <= high)


def field_values(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy:
    kind = field.type
    if kind in INT_BOUNDS:
        return integers(*INT_BOUNDS[kind])
    if kind in (descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == descriptor.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == descriptor.FieldDescriptor.TYPE_STRING:
        if field.name == "dtype":  # a tensor's: the accepted names, lying, most often
            return st.one_of(st.sampled_from(sorted(WIRE_DTYPES)), st.text(max_size=8))
        return st.text(max_size=24)
    if kind == descriptor.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=96)
    if kind == descriptor.FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, 8)
    return messages(field.message_type, depth + 1)


@st.composite
def _message(draw, message_type: descriptor.Descriptor, depth: int) -> Message:
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(message_type)()
    if depth > 3:
        return message
    for field in message_type.fields:
        if not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            keys = field_values(field.message_type.fields_by_name["key"], depth)
            values = field_values(field.message_type.fields_by_name["value"], depth)
            entries = draw(st.dictionaries(keys, values, max_size=3))
            target = getattr(message, field.name)
            for key, value in entries.items():
                if field.message_type.fields_by_name["value"].message_type is not None:
                    target[key].CopyFrom(value)
                else:
                    target[key] = value
        elif field.is_repeated:
            items = draw(st.lists(field_values(field, depth), max_size=4 if depth < 2 else 1))
            getattr(message, field.name).extend(items)
        elif field.message_type is not None:
            getattr(message, field.name).CopyFrom(draw(field_values(field, depth)))
        else:
            setattr(message, field.name, draw(field_values(field, depth)))
    return message


def messages(message_type: descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    return _message(message_type, depth)


def with_bad_utf8(data: bytes, message_type: descriptor.Descriptor) -> bytes:
    """`data` with a string field set (last one wins) to bytes that are not UTF-8."""
    strings = [f for f in message_type.fields if f.type == descriptor.FieldDescriptor.TYPE_STRING]
    if not strings:
        return data + b"\xff"
    bad = b"\xff\xfe\xc3("
    tag = (strings[0].number << 3) | 2  # length-delimited
    return data + bytes([tag]) + bytes([len(bad)]) + bad if tag < 128 else data + b"\xff"


def valid_examples(target: str) -> dict[str, list[Message]]:
    """A valid request of each kind, the seeds of the mutated ones."""
    return {
        "Generate": [chat([user("hi")]), chat([user("hi")], session_id=target)],
        "CreateSession": [generation_pb2.CreateSessionRequest(session_id="fuzz")],
        "CloseSession": [generation_pb2.CloseSessionRequest(session_id="fuzz")],
        "Prefill": [prefill_request(), jury_prefill_request()],
        "PrefillBatch": [internal_pb2.TrunkPrefillBatchRequest(calls=[prefill_request()])],
        "Draft": [draft_request()],
        "Uncertainty": [
            internal_pb2.UncertaintyRequest(prompt_tokens=[5, 6], answer_token=7, check_tokens=[8])
        ],
        "Score": [score_request()],
        "ScoreBatch": [internal_pb2.ScoreBatchRequest(calls=[score_request()])],
        "Release": [internal_pb2.ReleaseRequest(session="s")],
    }


# (server name in the stack, service, method): every RPC of every service.
SERVICES = {
    "orchestrator": generation_pb2.DESCRIPTOR.services_by_name["Generation"],
    "trunk": internal_pb2.DESCRIPTOR.services_by_name["Trunk"],
    "jury0": internal_pb2.DESCRIPTOR.services_by_name["Jury"],
}
RPCS = [(server, method) for server, service in SERVICES.items() for method in service.methods]


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url)
    stack.start_services().start_orchestrator()
    yield stack
    stack.close()


@dataclass
class Canary:
    """A session made before the fuzzing, which the fuzzing never names, and what its
    turns gave then: its first turn's output, and the second turn's, computed on a twin
    session (the same first turn) so that the canary's own second turn can come after."""

    session_id: str
    first: list[int]
    second: list[int]
    target: str  # a session the fuzzed requests may name (continue, close)


def canary_turns(generation, session_id: str) -> list[int]:
    first = generation.Generate(canary_request(session_id, "canary", "canary-1"), timeout=30)
    return list(first.token_ids)


def canary_request(session_id: str, text: str, request_id: str) -> generation_pb2.GenerateRequest:
    return chat([user(text)], session_id=session_id, request_id=request_id, **CANARY)


def new_session(generation) -> str:
    return generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=10).session_id


@pytest.fixture(scope="module")
def canary(stack) -> Canary:
    generation = stack.generation()
    session_id, twin = new_session(generation), new_session(generation)
    first = canary_turns(generation, session_id)
    assert canary_turns(generation, twin) == first
    second = generation.Generate(canary_request(twin, "more", "canary-2"), timeout=30)
    return Canary(session_id, first, list(second.token_ids), new_session(generation))


def call(stack: Stack, server: str, method: descriptor.MethodDescriptor, data: bytes) -> None:
    """Sends `data` as the request of `method`; fails on a bug's status or a hang."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    channel = stack.channel(server) if server not in CHANNELS else CHANNELS[server]
    CHANNELS[server] = channel
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    rpc = kind(path, request_serializer=None, response_deserializer=None)
    try:
        response = rpc(data, timeout=CALL_TIMEOUT_S)
        if method.server_streaming:
            list(response)
    except grpc.RpcError as error:
        assert error.code() not in BUGS, f"{path}: {error.code().name}: {error.details()}"
        assert error.details(), f"{path}: {error.code().name} without a detail"


CHANNELS: dict[str, grpc.Channel] = {}


@pytest.mark.parametrize(("server", "method"), RPCS, ids=[f"{s}-{m.name}" for s, m in RPCS])
def test_every_rpc_survives_fuzzed_input(stack, canary, server, method):
    examples = valid_examples(canary.target)
    seeds = [m for kind in examples.values() for m in kind if m.DESCRIPTOR is method.input_type]
    random_messages = messages(method.input_type)
    mutated = (
        st.tuples(st.sampled_from(seeds), random_messages).map(_merged)
        if seeds
        else random_messages
    )

    @FUZZ
    @given(
        st.one_of(
            random_messages.map(lambda m: m.SerializeToString()),
            mutated.map(lambda m: m.SerializeToString()),
            mutated.map(lambda m: with_bad_utf8(m.SerializeToString(), method.input_type)),
            st.binary(max_size=256),
        )
    )
    def fuzz(data: bytes) -> None:
        call(stack, server, method, data)

    fuzz()
    _assert_healthy(stack)


@pytest.mark.parametrize("server", sorted(SERVICES))
def test_bytes_that_are_no_message_are_invalid_argument(stack, server):
    """Found by the fuzzing: gRPC answered a request it could not decode with UNKNOWN."""
    method = SERVICES[server].methods_by_name["Info"]
    path = f"/{method.containing_service.full_name}/{method.name}"
    with pytest.raises(grpc.RpcError) as raised:
        stack.channel(server).unary_unary(path)(b"\xff", timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request is not a valid message of its type" in raised.value.details()


def _merged(pair: tuple[Message, Message]) -> Message:
    seed, mutation = pair
    message = type(seed)()
    message.CopyFrom(seed)
    message.MergeFrom(mutation)
    return message


def _assert_healthy(stack: Stack) -> None:
    for server in SERVICES:
        health = health_pb2_grpc.HealthStub(stack.channel(server))
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, server


def test_the_canary_session_is_intact_after_the_fuzzing(stack, canary):
    """Runs after the fuzzing (module order): the canary's first turn sent again is its
    stored output, and its second turn (its caches maybe taken by the fuzzed sessions
    meanwhile) gives the tokens its twin's did before the fuzzing."""
    generation = stack.generation()
    replayed = generation.Generate(canary_request(canary.session_id, "canary", "canary-1"), 30)
    assert list(replayed.token_ids) == canary.first
    second = generation.Generate(canary_request(canary.session_id, "more", "canary-2"), 30)
    assert list(second.token_ids) == canary.second


@FUZZ
@given(
    messages(tensor_pb2.DESCRIPTOR.message_types_by_name["Tensor"]),
    st.lists(st.one_of(st.none(), st.integers(0, 8)), max_size=3),
)
def test_the_tensor_codec_refuses_with_a_codec_error_only(message, shape):
    try:
        tensor = tensor_from_pb(message, name="t", dtypes=sorted(WIRE_DTYPES), shape=shape)
    except CodecError as error:
        assert str(error).startswith("t: ")
    else:
        assert list(tensor.shape) == list(message.shape)
        assert tensor_to_pb(tensor) == message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def documents() -> st.SearchStrategy[str]:
    """Session documents: a real one with a field replaced by any JSON value or dropped,
    any JSON at all, and a real one cut short."""
    record = SessionRecord("s1", "c1", messages=[{"role": "user", "content": "hi"}])
    values = json.loads(record.document())
    values["generation"] = {"request_id": "r", "digest": "d", "context_length": 2, "progress": {}}
    names = sorted(values)
    replaced = st.tuples(st.sampled_from(names), JSON).map(
        lambda change: json.dumps({**values, change[0]: change[1]})
    )
    dropped = st.sampled_from(names).map(
        lambda name: json.dumps({k: v for k, v in values.items() if k != name})
    )
    cut = st.integers(0, 40).map(lambda n: json.dumps(values)[:n])
    return st.one_of(replaced, dropped, JSON.map(json.dumps), cut)


@FUZZ
@given(documents())
# Found by the fuzzing: these raised AttributeError and TypeError from inside the decoder.
@example("null")
@example(json.dumps({"session_id": "s1"}))
def test_the_session_record_decoder_refuses_a_corrupt_document_with_a_value_error(document):
    try:
        decoded = SessionRecord.from_document(document)
    except ValueError as error:
        assert "not a session record document" in str(error) or isinstance(
            error, json.JSONDecodeError
        )
        return
    assert isinstance(decoded, SessionRecord)
