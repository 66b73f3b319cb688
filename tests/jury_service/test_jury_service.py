"""The jury service: it gives what the jury worker gives, takes hidden states only in
its dtype, and rejects bad input with the right status code and a readable message."""

from __future__ import annotations

import grpc
import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.protos.codec import tensor_to_pb
from hydra_jury.protos.hydrajury.v1 import internal_pb2, tensor_pb2
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.sessions import SessionLimits
from tests import calls
from tests.worker_services import (
    HIDDEN_SIZE,
    PROMPT,
    assert_error,
    assert_refused,
    decoded,
    jury_prefill_request,
    prefill_request,
    score_request,
)

Code = grpc.StatusCode


def test_jury_rpcs_match_the_worker(start_jury, jury_checkpoint, jury_model):
    jury = start_jury(heads=["head1", "head3"])
    worker = JuryWorker(
        HydraModel.load(jury_checkpoint, heads=["head1", "head3"], load_trunk=False),
        limits=SessionLimits(1, 32),
    )
    tokens = torch.tensor([*PROMPT, 11, 12, 13])
    hidden = jury_model.trunk.forward(tokens, jury_model.trunk_cache(32), 0)  # [8, D]
    worker.prefill(calls.jury_prefill("s", 0, hidden[:5]))
    expected = worker.score(
        calls.score("s", 5, hidden[5:], ["head0", "head1", "head3"], 0.7, 2.0, True)
    )

    prefill = jury.stub.Prefill(
        internal_pb2.JuryPrefillRequest(session="s", start=0, hidden=tensor_to_pb(hidden[:5]))
    )
    assert prefill.timings.total_ns >= prefill.timings.forward_ns > 0
    # head0 is a juror this shard does not host: it answers for head1 and head3.
    score = jury.stub.Score(
        score_request(
            start=5,
            hidden=tensor_to_pb(hidden[5:]),
            jury=["head0", "head1", "head3"],
            temperature=0.7,
            beta=2.0,
            with_decision=True,
        )
    )
    assert tuple(score.voters) == expected.voters == ("head1", "head3")
    assert score.log_product.dtype == score.decision_log_product.dtype == "float32"
    assert torch.equal(decoded(score.log_product), expected.log_product)
    assert torch.equal(decoded(score.decision_log_product), expected.decision_log_product)
    assert torch.equal(decoded(score.votes), expected.votes)
    assert score.head_evaluations == 3 * 2
    assert score.timings.total_ns >= score.timings.forward_ns > 0
    assert not jury.stub.Score(score_request(start=5, hidden=tensor_to_pb(hidden[5:]))).HasField(
        "decision_log_product"
    )


def test_hidden_states_travel_in_the_service_dtype(start_trunk, start_jury):
    trunk = start_trunk(dtype="bfloat16")
    jury_bf16, jury_fp32 = start_jury(dtype="bfloat16"), start_jury()
    assert trunk.stub.Info(internal_pb2.InfoRequest()).model.dtype == "bfloat16"
    hidden = trunk.stub.Prefill(prefill_request()).hidden
    assert hidden.dtype == "bfloat16" and list(hidden.shape) == [5, HIDDEN_SIZE]
    request = internal_pb2.JuryPrefillRequest(session="s", start=0, hidden=hidden)
    jury_bf16.stub.Prefill(request)
    assert_error(
        jury_fp32.stub.Prefill,
        request,
        Code.INVALID_ARGUMENT,
        r"hidden: dtype 'bfloat16' is not accepted here; expected float32",
    )


def _truncated(message: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    message.data = message.data[:-1]
    return message


BAD_REQUESTS = {
    # name: (method, request, code, message pattern)
    "wrong hidden dtype": (
        "Prefill",
        internal_pb2.JuryPrefillRequest(
            session="s", hidden=tensor_to_pb(torch.zeros(2, HIDDEN_SIZE, dtype=torch.float16))
        ),
        Code.INVALID_ARGUMENT,
        r"hidden: dtype 'float16' is not accepted here; expected float32",
    ),
    "wrong hidden shape": (
        "Prefill",
        internal_pb2.JuryPrefillRequest(session="s", hidden=tensor_to_pb(torch.zeros(2, 63))),
        Code.INVALID_ARGUMENT,
        r"hidden: shape \[2, 63\] does not match \[\*, 64\]",
    ),
    "truncated hidden bytes": (
        "Score",
        score_request(hidden=_truncated(tensor_to_pb(torch.zeros(2, HIDDEN_SIZE)))),
        Code.INVALID_ARGUMENT,
        r"hidden: 511 bytes of data, but shape \[2, 64\] of float32 needs 512",
    ),
    "no hidden positions": (
        "Score",
        score_request(hidden=tensor_to_pb(torch.zeros(0, HIDDEN_SIZE))),
        Code.INVALID_ARGUMENT,
        r"hidden: at least one position is required",
    ),
    "unknown juror": (
        "Score",
        score_request(jury=["head1", "head9"]),
        Code.INVALID_ARGUMENT,
        r"jury: unknown heads \['head9'\]; the checkpoint has \['head0'",
    ),
    "juror twice": (
        "Score",
        score_request(jury=["head1", "head1"]),
        Code.INVALID_ARGUMENT,
        r"jury: a head is named twice",
    ),
    "negative temperature": (
        "Score",
        score_request(temperature=-0.5),
        Code.INVALID_ARGUMENT,
        r"temperature: must be finite and >= 0",
    ),
    "beta 0": (
        "Score",
        score_request(beta=0.0),
        Code.INVALID_ARGUMENT,
        r"beta: must be in \(0, 100\], got 0\.0",
    ),
    "beta above 100": (
        "Score",
        score_request(beta=100.5),
        Code.INVALID_ARGUMENT,
        r"beta: must be in \(0, 100\], got 100\.5",
    ),
    "unknown jury session": (
        "Score",
        score_request(session="ghost", start=2),
        Code.FAILED_PRECONDITION,
        r"unknown session 'ghost': this service holds no positions of it",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_their_status_code_and_a_readable_message(jury, case):
    assert_refused(jury, *BAD_REQUESTS[case])


def test_jury_positions_and_capacity(jury):
    jury.stub.Prefill(jury_prefill_request(positions=3))
    assert_error(
        jury.stub.Score,
        score_request(start=4),
        Code.FAILED_PRECONDITION,
        r"the jury holds 3 positions of this session; cannot start at 4",
    )
    assert_error(
        jury.stub.Prefill,
        jury_prefill_request(start=3, positions=30),
        Code.RESOURCE_EXHAUSTED,
        r"the session would reach 33 positions, over the limit of 32 tokens per session",
    )
    jury.stub.Prefill(jury_prefill_request(session="b"))
    assert_error(
        jury.stub.Prefill,
        jury_prefill_request(session="c"),
        Code.RESOURCE_EXHAUSTED,
        r"all 2 sessions are in use",
    )
