"""The trunk service: it gives what the trunk worker gives, and rejects bad input with
the right status code and a readable message."""

from __future__ import annotations

import grpc
import pytest
import torch

from hydra_jury.protos.hydrajury.v1 import internal_pb2, tensor_pb2
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests import calls
from tests.worker_services import (
    GREEDY,
    PROMPT,
    PROMPT_LENGTH,
    SAMPLED,
    assert_error,
    assert_refused,
    decoded,
    draft_request,
    prefill_request,
    sampling_to_pb,
)

Code = grpc.StatusCode


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_trunk_rpcs_match_the_worker(trunk, jury_model, sampling):
    worker = TrunkWorker(jury_model, limits=SessionLimits(1, 32))
    expected_hidden = worker.prefill(calls.prefill("s", 0, PROMPT)).tensor()
    expected = worker.draft(calls.draft("s", 5, 11, 4, "head1", sampling, 7, True))

    prefill = trunk.stub.Prefill(prefill_request())
    assert prefill.hidden.dtype == "float32"
    assert torch.equal(decoded(prefill.hidden), expected_hidden)
    assert prefill.timings.total_ns >= prefill.timings.forward_ns > 0
    draft = trunk.stub.Draft(
        draft_request(
            draft_head="head1", sampling=sampling_to_pb(sampling), seed=7, with_decision=True
        )
    )
    assert list(draft.tokens) == expected.tokens.tolist()
    assert draft.logprobs.dtype == draft.decision_logprobs.dtype == "float32"
    assert torch.equal(decoded(draft.logprobs), expected.logprobs)
    assert torch.equal(decoded(draft.decision_logprobs), expected.decision_logprobs)
    assert torch.equal(decoded(draft.hidden), expected.hidden.tensor())
    assert (draft.trunk_steps, draft.head_evaluations) == (4, 4)
    assert draft.timings.total_ns >= draft.timings.forward_ns > 0

    # Without a draft head: one trunk step, no tokens or distributions.
    pending = int(expected.tokens[-1])
    expected_step = worker.draft(calls.draft("s", 9, pending, 1, None, sampling, 7))
    step = trunk.stub.Draft(draft_request(start=9, pending=pending, gamma=1, draft_head=""))
    assert list(step.tokens) == [] and not step.HasField("logprobs")
    assert torch.equal(decoded(step.hidden), expected_step.hidden.tensor())
    assert (step.trunk_steps, step.head_evaluations) == (1, 0)


BAD_REQUESTS = {
    # name: (method, request, code, message pattern)
    "empty session": (
        "Prefill",
        prefill_request(session=""),
        Code.INVALID_ARGUMENT,
        r"session: a non-empty session id is required",
    ),
    "negative start": (
        "Prefill",
        prefill_request(start=-1),
        Code.INVALID_ARGUMENT,
        r"start: must be >= 0, got -1",
    ),
    "token out of vocab": (
        "Prefill",
        prefill_request(tokens=[5, 32]),
        Code.INVALID_ARGUMENT,
        r"tokens: token id 32 is outside the vocabulary \[0, 32\)",
    ),
    "negative token": (
        "Prefill",
        prefill_request(tokens=[-3]),
        Code.INVALID_ARGUMENT,
        r"tokens: token id -3 is outside",
    ),
    "no tokens": (
        "Prefill",
        prefill_request(tokens=[]),
        Code.INVALID_ARGUMENT,
        r"tokens: at least one token is required",
    ),
    "pending token out of vocab": (
        "Draft",
        draft_request(start=0, pending=40),
        Code.INVALID_ARGUMENT,
        r"pending_token: token id 40 is outside",
    ),
    "gamma 0": (
        "Draft",
        draft_request(start=0, gamma=0),
        Code.INVALID_ARGUMENT,
        r"gamma: must be in 1\.\.16, got 0",
    ),
    "gamma 17": (
        "Draft",
        draft_request(start=0, gamma=17),
        Code.INVALID_ARGUMENT,
        r"gamma: must be in 1\.\.16, got 17",
    ),
    "gamma without draft head": (
        "Draft",
        draft_request(start=0, gamma=2, draft_head=""),
        Code.INVALID_ARGUMENT,
        r"gamma: must be 1 without a draft_head",
    ),
    "unknown draft head": (
        "Draft",
        draft_request(start=0, draft_head="head9"),
        Code.INVALID_ARGUMENT,
        r"draft_head: 'head9' is not a drafter of this service; drafters: \['head0', ",
    ),
    "bad sampling": (
        "Draft",
        draft_request(start=0, sampling=tensor_pb2.SamplingParams(temperature=1.0, top_p=0)),
        Code.INVALID_ARGUMENT,
        r"sampling: top_p must be in \(0, 1\]",
    ),
    "missing sampling": (
        "Draft",
        draft_request(start=0, sampling=None),
        Code.INVALID_ARGUMENT,
        r"sampling: required when drafting",
    ),
    "seed too large": (
        "Draft",
        draft_request(start=0, seed=2**63),
        Code.INVALID_ARGUMENT,
        r"seed: must be below 2\*\*63",
    ),
    "unknown trunk session": (
        "Draft",
        draft_request(session="ghost", start=3),
        Code.FAILED_PRECONDITION,
        r"unknown session 'ghost': this service holds no positions of it",
    ),
    "empty session on release": (
        "Release",
        internal_pb2.ReleaseRequest(),
        Code.INVALID_ARGUMENT,
        r"session: a non-empty session id is required",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_their_status_code_and_a_readable_message(trunk, case):
    assert_refused(trunk, *BAD_REQUESTS[case])


def test_trunk_positions_and_capacity(trunk):
    trunk.stub.Prefill(prefill_request(tokens=[5, 6, 7]))
    assert_error(
        trunk.stub.Draft,
        draft_request(start=5),
        Code.FAILED_PRECONDITION,
        r"the trunk holds 3 positions of this session; cannot start at 5 \(re-prefill from 3\)",
    )
    assert_error(
        trunk.stub.Prefill,
        prefill_request(start=3, tokens=[5] * 30),
        Code.RESOURCE_EXHAUSTED,
        r"the session would reach 33 positions, over the limit of 32 tokens per session",
    )
    trunk.stub.Prefill(prefill_request(session="b", tokens=[5]))
    assert_error(
        trunk.stub.Prefill,
        prefill_request(session="c", tokens=[5]),
        Code.RESOURCE_EXHAUSTED,
        r"all 2 sessions are in use",
    )


def test_a_finished_session_keeps_its_caches_until_a_newcomer_needs_its_slot(start_trunk):
    trunk = start_trunk(max_sessions=1, reclaim_after_s=60)
    keep = internal_pb2.ReleaseRequest(session="a", keep_caches=True)
    trunk.stub.Prefill(prefill_request("a"))
    assert trunk.stub.Release(keep).released
    # Its next turn continues from its caches, and ends again.
    trunk.stub.Prefill(prefill_request("a", start=PROMPT_LENGTH, tokens=[11]))
    trunk.stub.Release(keep)
    trunk.stub.Prefill(prefill_request("b"))  # takes the finished slot at once
    assert_error(
        trunk.stub.Prefill,
        prefill_request("a", start=PROMPT_LENGTH + 1, tokens=[12]),
        Code.FAILED_PRECONDITION,
        "re-prefill from 0",
    )
    assert_error(  # "b" is running, within the minute's grace
        trunk.stub.Prefill,
        prefill_request("c"),
        Code.RESOURCE_EXHAUSTED,
        "all 1 sessions are in use by running generations",
    )
    nobody = internal_pb2.ReleaseRequest(session="nobody", keep_caches=True)
    assert not trunk.stub.Release(nobody).released
    registry = trunk.servicer.metrics.registry
    assert (
        registry.get_sample_value("hydrajury_reclaimed_sessions_total", {"reason": "finished"}) == 1
    )
    refused = {"rpc": "Prefill", "reason": "sessions_running"}
    assert registry.get_sample_value("hydrajury_refused_calls_total", refused) == 1
    assert registry.get_sample_value("hydrajury_service_running_sessions") == 1
    assert registry.get_sample_value("hydrajury_service_sessions") == 1
