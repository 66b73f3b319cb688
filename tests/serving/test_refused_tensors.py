"""The internal services refuse bad input over real gRPC before it reaches a cache: hidden
states that are not finite, of the wrong shape, dtype or length (the jury), token ids
outside the vocabulary (the trunk). Each is INVALID_ARGUMENT with a readable detail, and
afterwards the service is healthy and the session it was aimed at holds exactly what it
held before."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydra_jury.protos.codec import tensor_to_pb
from hydra_jury.protos.hydrajury.v1 import internal_pb2, tensor_pb2
from tests.worker_services import (
    HIDDEN_SIZE,
    PROMPT,
    PROMPT_LENGTH,
    Service,
    assert_error,
    decoded,
    draft_request,
    prefill_request,
    score_request,
)

Code = grpc.StatusCode
DRAFTED = 2  # the positions a Score call covers after the prompt


def _poisoned(value: float) -> torch.Tensor:
    hidden = torch.randn(DRAFTED, HIDDEN_SIZE)
    hidden[1, 3] = value
    return hidden


def _truncated(hidden: torch.Tensor) -> tensor_pb2.Tensor:
    message = tensor_to_pb(hidden)
    message.data = message.data[:-1]
    return message


BAD_HIDDEN_STATES = {
    # name: (hidden-state message, detail pattern)
    "nan": (tensor_to_pb(_poisoned(float("nan"))), r"hidden: values must be finite, got nan at"),
    "inf": (
        tensor_to_pb(_poisoned(float("inf"))),
        r"hidden: values must be finite, got inf at \[1, 3\] \(1 of 128 not finite\)",
    ),
    "-inf": (tensor_to_pb(_poisoned(float("-inf"))), r"got -inf at \[1, 3\]"),
    "float16": (
        tensor_to_pb(torch.zeros(DRAFTED, HIDDEN_SIZE, dtype=torch.float16)),
        r"hidden: dtype 'float16' is not accepted here; expected float32",
    ),
    "int64": (
        tensor_to_pb(torch.zeros(DRAFTED, HIDDEN_SIZE, dtype=torch.long)),
        r"hidden: dtype 'int64' is not accepted here",
    ),
    "wrong width": (
        tensor_to_pb(torch.zeros(DRAFTED, HIDDEN_SIZE + 1)),
        r"hidden: shape \[2, 65\] does not match \[\*, 64\]",
    ),
    "wrong rank": (
        tensor_to_pb(torch.zeros(DRAFTED * HIDDEN_SIZE)),
        r"hidden: shape \[128\] does not match \[\*, 64\]",
    ),
    "truncated": (
        _truncated(torch.zeros(DRAFTED, HIDDEN_SIZE)),
        r"hidden: 511 bytes of data, but shape \[2, 64\] of float32 needs 512",
    ),
}


def assert_serving(service: Service, name: str) -> None:
    health = health_pb2_grpc.HealthStub(service.channel)
    for checked in ("", name):
        reply = health.Check(health_pb2.HealthCheckRequest(service=checked), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("case", BAD_HIDDEN_STATES, ids=list(BAD_HIDDEN_STATES))
def test_the_jury_refuses_bad_hidden_states_and_keeps_the_session(jury, jury_model, case):
    bad, detail = BAD_HIDDEN_STATES[case]
    tokens = torch.tensor([*PROMPT, 11, 12])
    hidden = jury_model.trunk.forward(tokens, jury_model.trunk_cache(32), 0)
    prompt, drafted = tensor_to_pb(hidden[:PROMPT_LENGTH]), tensor_to_pb(hidden[PROMPT_LENGTH:])
    # The same work on a session of its own, for reference: a score writes its positions.
    jury.stub.Prefill(internal_pb2.JuryPrefillRequest(session="ref", start=0, hidden=prompt))
    expected = jury.stub.Score(score_request(session="ref", start=PROMPT_LENGTH, hidden=drafted))
    jury.stub.Prefill(internal_pb2.JuryPrefillRequest(session="s", start=0, hidden=prompt))

    # Aimed at the session's next positions (a score, a prefill) and at a new session.
    refused = [
        ("Score", score_request(start=PROMPT_LENGTH, hidden=bad)),
        ("Prefill", internal_pb2.JuryPrefillRequest(session="s", start=PROMPT_LENGTH, hidden=bad)),
        ("Prefill", internal_pb2.JuryPrefillRequest(session="new", start=0, hidden=bad)),
        ("ScoreBatch", internal_pb2.ScoreBatchRequest(calls=[score_request(start=5, hidden=bad)])),
    ]
    for method, request in refused:
        assert_error(getattr(jury.stub, method), request, Code.INVALID_ARGUMENT, detail)

    assert_serving(jury, "hydrajury.v1.Jury")
    assert jury.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions == 2
    # Nothing was written past the prompt, and the session scores as it did before.
    assert_error(
        jury.stub.Score,
        score_request(start=PROMPT_LENGTH + 1, hidden=drafted),
        Code.FAILED_PRECONDITION,
        rf"the jury holds {PROMPT_LENGTH} positions of this session",
    )
    again = jury.stub.Score(score_request(start=PROMPT_LENGTH, hidden=drafted))
    assert torch.equal(decoded(again.log_product), decoded(expected.log_product))
    assert torch.equal(decoded(again.votes), decoded(expected.votes))


BAD_TOKENS = {
    # name: (method, request, detail pattern)
    "prefill past the vocabulary": (
        "Prefill",
        prefill_request(start=PROMPT_LENGTH, tokens=[5, 40]),
        r"tokens: token id 40 is outside the vocabulary \[0, 32\)",
    ),
    "negative prefill token": (
        "Prefill",
        prefill_request(start=PROMPT_LENGTH, tokens=[-1]),
        r"tokens: token id -1 is outside",
    ),
    "pending token past the vocabulary": (
        "Draft",
        draft_request(pending=2**40),
        r"pending_token: token id 1099511627776 is outside",
    ),
}


@pytest.mark.parametrize("case", BAD_TOKENS, ids=list(BAD_TOKENS))
def test_the_trunk_refuses_bad_token_ids_and_keeps_the_session(trunk, case):
    method, request, detail = BAD_TOKENS[case]
    trunk.stub.Prefill(prefill_request(session="ref"))
    expected = trunk.stub.Draft(draft_request(session="ref"))
    trunk.stub.Prefill(prefill_request())

    assert_error(getattr(trunk.stub, method), request, Code.INVALID_ARGUMENT, detail)

    assert_serving(trunk, "hydrajury.v1.Trunk")
    assert trunk.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions == 2
    assert_error(
        trunk.stub.Draft,
        draft_request(start=PROMPT_LENGTH + 1),
        Code.FAILED_PRECONDITION,
        rf"the trunk holds {PROMPT_LENGTH} positions of this session",
    )
    again = trunk.stub.Draft(draft_request())
    assert list(again.tokens) == list(expected.tokens)
    assert torch.equal(decoded(again.hidden), decoded(expected.hidden))
