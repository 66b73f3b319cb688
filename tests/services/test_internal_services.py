"""The trunk and jury gRPC services: they give what the workers give, reject bad input
with the right status code and a readable message, and start and stop cleanly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hydra_model import HydraModel
from orchestrator.launcher import start_child
from poe import SamplingParams
from protos.codec import tensor_from_pb, tensor_to_pb
from protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc, tensor_pb2
from serving import internal_wire as wire
from serving.internal_wire import sampling_to_pb
from serving.worker_service import ServiceOptions, serve_worker, service_main
from tests import calls
from trunk_service.server import TRUNK_SERVICE
from workers.jury import JuryWorker
from workers.sessions import SessionLimits
from workers.trunk import TrunkWorker

Code = grpc.StatusCode
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
PROMPT = [5, 6, 7, 9, 10]
PROMPT_LENGTH = len(PROMPT)
HIDDEN_SIZE = 64


def trunk_main(argv: list[str]) -> int:
    return service_main(TRUNK_SERVICE, argv)


def prefill_request(session="s", start=0, tokens=PROMPT) -> internal_pb2.TrunkPrefillRequest:
    return internal_pb2.TrunkPrefillRequest(session=session, start=start, tokens=tokens)


def draft_request(
    session="s", start=PROMPT_LENGTH, pending=11, gamma=4, draft_head="head0", **fields
) -> internal_pb2.DraftRequest:
    fields.setdefault("sampling", sampling_to_pb(GREEDY))
    return internal_pb2.DraftRequest(
        session=session,
        start=start,
        pending_token=pending,
        gamma=gamma,
        draft_head=draft_head,
        **fields,
    )


def jury_prefill_request(session="s", start=0, positions=3) -> internal_pb2.JuryPrefillRequest:
    return internal_pb2.JuryPrefillRequest(
        session=session, start=start, hidden=tensor_to_pb(torch.zeros(positions, HIDDEN_SIZE))
    )


def score_request(session="s", start=0, hidden=None, **fields) -> internal_pb2.ScoreRequest:
    fields = {"jury": ["head0", "head1"], "temperature": 1.0, "beta": 1.0, **fields}
    if hidden is None:
        hidden = tensor_to_pb(torch.zeros(2, HIDDEN_SIZE))
    return internal_pb2.ScoreRequest(session=session, start=start, hidden=hidden, **fields)


def decoded(message: tensor_pb2.Tensor) -> torch.Tensor:
    return tensor_from_pb(
        message, name="t", dtypes=[message.dtype], shape=[None] * len(message.shape)
    )


def assert_error(method, request, code: grpc.StatusCode, message: str) -> None:
    """`method(request)` fails with `code` and details matching `message`."""
    with pytest.raises(grpc.RpcError) as caught:
        method(request, timeout=10)
    error = caught.value
    assert error.code() == code, error.details()
    assert re.search(message, error.details()), error.details()


# --- Info, health, reflection ---------------------------------------------------------


def test_info_describes_the_model_the_heads_and_the_limits(start_trunk, start_jury, jury_model):
    trunk = start_trunk(heads=["head2", "head0"], idle_timeout_s=60)
    jury = start_jury(heads=["head3", "head1"])
    trunk_info = trunk.stub.Info(internal_pb2.InfoRequest())
    jury_info = jury.stub.Info(internal_pb2.InfoRequest())
    for info in (trunk_info, jury_info):
        model = info.model
        assert model.fingerprint == jury_model.fingerprint
        assert (model.architecture, model.vocab_size, model.hidden_size) == ("llama", 32, 64)
        assert model.context_length == 32  # the session limit, below the model's 256
        assert list(model.heads) == ["head0", "head1", "head2", "head3"]
        assert list(model.eos_token_ids) == list(jury_model.config.eos_token_ids)
        assert model.dtype == "float32"
        assert len(info.epoch) == 16
    # Head lists come in checkpoint order whatever the order asked for.
    assert list(trunk_info.drafter_heads) == ["head0", "head2"]
    assert list(jury_info.hosted_heads) == ["head1", "head3"]
    assert trunk_info.limits == internal_pb2.ServiceLimits(
        max_sessions=2, max_session_tokens=32, active_sessions=0, idle_timeout_s=60.0
    )
    assert jury_info.limits.idle_timeout_s == 0  # never evicted


def test_health_and_reflection(trunk, jury):
    for service, name in ((trunk, "hydrajury.v1.Trunk"), (jury, "hydrajury.v1.Jury")):
        health = health_pb2_grpc.HealthStub(service.channel)
        for checked in ("", name):
            reply = health.Check(health_pb2.HealthCheckRequest(service=checked), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(service.channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        listed = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {name, "grpc.health.v1.Health"} <= listed


# --- Same results as the workers ------------------------------------------------------


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


# --- Bad input ------------------------------------------------------------------------


def _truncated(message: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    message.data = message.data[:-1]
    return message


BAD_REQUESTS = {
    # name: (service, method, request, code, message pattern)
    "empty session": (
        "trunk",
        "Prefill",
        prefill_request(session=""),
        Code.INVALID_ARGUMENT,
        r"session: a non-empty session id is required",
    ),
    "negative start": (
        "trunk",
        "Prefill",
        prefill_request(start=-1),
        Code.INVALID_ARGUMENT,
        r"start: must be >= 0, got -1",
    ),
    "token out of vocab": (
        "trunk",
        "Prefill",
        prefill_request(tokens=[5, 32]),
        Code.INVALID_ARGUMENT,
        r"tokens: token id 32 is outside the vocabulary \[0, 32\)",
    ),
    "negative token": (
        "trunk",
        "Prefill",
        prefill_request(tokens=[-3]),
        Code.INVALID_ARGUMENT,
        r"tokens: token id -3 is outside",
    ),
    "no tokens": (
        "trunk",
        "Prefill",
        prefill_request(tokens=[]),
        Code.INVALID_ARGUMENT,
        r"tokens: at least one token is required",
    ),
    "pending token out of vocab": (
        "trunk",
        "Draft",
        draft_request(start=0, pending=40),
        Code.INVALID_ARGUMENT,
        r"pending_token: token id 40 is outside",
    ),
    "gamma 0": (
        "trunk",
        "Draft",
        draft_request(start=0, gamma=0),
        Code.INVALID_ARGUMENT,
        r"gamma: must be in 1\.\.16, got 0",
    ),
    "gamma 17": (
        "trunk",
        "Draft",
        draft_request(start=0, gamma=17),
        Code.INVALID_ARGUMENT,
        r"gamma: must be in 1\.\.16, got 17",
    ),
    "gamma without draft head": (
        "trunk",
        "Draft",
        draft_request(start=0, gamma=2, draft_head=""),
        Code.INVALID_ARGUMENT,
        r"gamma: must be 1 without a draft_head",
    ),
    "unknown draft head": (
        "trunk",
        "Draft",
        draft_request(start=0, draft_head="head9"),
        Code.INVALID_ARGUMENT,
        r"draft_head: 'head9' is not a drafter of this service; drafters: \['head0', ",
    ),
    "bad sampling": (
        "trunk",
        "Draft",
        draft_request(start=0, sampling=tensor_pb2.SamplingParams(temperature=1.0, top_p=0)),
        Code.INVALID_ARGUMENT,
        r"sampling: top_p must be in \(0, 1\]",
    ),
    "missing sampling": (
        "trunk",
        "Draft",
        draft_request(start=0, sampling=None),
        Code.INVALID_ARGUMENT,
        r"sampling: required when a draft_head is given",
    ),
    "seed too large": (
        "trunk",
        "Draft",
        draft_request(start=0, seed=2**63),
        Code.INVALID_ARGUMENT,
        r"seed: must be below 2\*\*63",
    ),
    "unknown trunk session": (
        "trunk",
        "Draft",
        draft_request(session="ghost", start=3),
        Code.FAILED_PRECONDITION,
        r"unknown session 'ghost': this service holds no positions of it",
    ),
    "empty session on release": (
        "trunk",
        "Release",
        internal_pb2.ReleaseRequest(),
        Code.INVALID_ARGUMENT,
        r"session: a non-empty session id is required",
    ),
    "wrong hidden dtype": (
        "jury",
        "Prefill",
        internal_pb2.JuryPrefillRequest(
            session="s", hidden=tensor_to_pb(torch.zeros(2, HIDDEN_SIZE, dtype=torch.float16))
        ),
        Code.INVALID_ARGUMENT,
        r"hidden: dtype 'float16' is not accepted here; expected float32",
    ),
    "wrong hidden shape": (
        "jury",
        "Prefill",
        internal_pb2.JuryPrefillRequest(session="s", hidden=tensor_to_pb(torch.zeros(2, 63))),
        Code.INVALID_ARGUMENT,
        r"hidden: shape \[2, 63\] does not match \[\*, 64\]",
    ),
    "truncated hidden bytes": (
        "jury",
        "Score",
        score_request(hidden=_truncated(tensor_to_pb(torch.zeros(2, HIDDEN_SIZE)))),
        Code.INVALID_ARGUMENT,
        r"hidden: 511 bytes of data, but shape \[2, 64\] of float32 needs 512",
    ),
    "no hidden positions": (
        "jury",
        "Score",
        score_request(hidden=tensor_to_pb(torch.zeros(0, HIDDEN_SIZE))),
        Code.INVALID_ARGUMENT,
        r"hidden: at least one position is required",
    ),
    "unknown juror": (
        "jury",
        "Score",
        score_request(jury=["head1", "head9"]),
        Code.INVALID_ARGUMENT,
        r"jury: unknown heads \['head9'\]; the checkpoint has \['head0'",
    ),
    "juror twice": (
        "jury",
        "Score",
        score_request(jury=["head1", "head1"]),
        Code.INVALID_ARGUMENT,
        r"jury: a head is named twice",
    ),
    "negative temperature": (
        "jury",
        "Score",
        score_request(temperature=-0.5),
        Code.INVALID_ARGUMENT,
        r"temperature: must be finite and >= 0",
    ),
    "beta 0": (
        "jury",
        "Score",
        score_request(beta=0.0),
        Code.INVALID_ARGUMENT,
        r"beta: must be in \(0, 100\], got 0\.0",
    ),
    "beta above 100": (
        "jury",
        "Score",
        score_request(beta=100.5),
        Code.INVALID_ARGUMENT,
        r"beta: must be in \(0, 100\], got 100\.5",
    ),
    "unknown jury session": (
        "jury",
        "Score",
        score_request(session="ghost", start=2),
        Code.FAILED_PRECONDITION,
        r"unknown session 'ghost': this service holds no positions of it",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_their_status_code_and_a_readable_message(trunk, jury, case):
    service, method, request, code, message = BAD_REQUESTS[case]
    target = {"trunk": trunk, "jury": jury}[service]
    assert_error(getattr(target.stub, method), request, code, message)
    # A rejected request holds nothing.
    assert target.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions == 0


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


# --- Sessions and epochs --------------------------------------------------------------


def test_release_frees_sessions_and_the_epoch_is_per_server(start_trunk, start_jury):
    trunk, other_trunk, jury = start_trunk(), start_trunk(), start_jury()

    def active(service) -> int:
        return service.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions

    epochs = {trunk.stub.Prefill(prefill_request(session=s)).epoch for s in ("a", "b")}
    epochs.add(trunk.stub.Draft(draft_request(session="a")).epoch)
    assert active(trunk) == 2
    release = trunk.stub.Release(internal_pb2.ReleaseRequest(session="a"))
    assert release.released and active(trunk) == 1
    again = trunk.stub.Release(internal_pb2.ReleaseRequest(session="a"))
    assert not again.released
    epochs |= {release.epoch, again.epoch, trunk.stub.Info(internal_pb2.InfoRequest()).epoch}
    assert len(epochs) == 1
    assert other_trunk.stub.Info(internal_pb2.InfoRequest()).epoch not in epochs

    jury_epoch = jury.stub.Prefill(jury_prefill_request()).epoch
    assert active(jury) == 1
    assert jury.stub.Release(internal_pb2.ReleaseRequest(session="s")).epoch == jury_epoch
    assert active(jury) == 0 and jury_epoch not in epochs


def test_idle_sessions_are_evicted_in_the_background(start_trunk):
    trunk = start_trunk(idle_timeout_s=0.05)
    trunk.stub.Prefill(prefill_request())
    deadline = time.monotonic() + 5
    while trunk.stub.Info(internal_pb2.InfoRequest()).limits.active_sessions:
        assert time.monotonic() < deadline, "the idle session was never evicted"
        time.sleep(0.02)
    assert_error(
        trunk.stub.Draft, draft_request(), Code.FAILED_PRECONDITION, r"unknown session 's'"
    )


# --- Command line ---------------------------------------------------------------------


def test_a_service_that_cannot_start_exits_2_with_one_line(
    tmp_path, capsys, jury_checkpoint, trunk
):
    assert trunk_main(["--checkpoint", str(tmp_path / "missing"), "--listen", "127.0.0.1:0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("trunk service: error: ") and error.count("\n") == 1, error
    argv = ["--checkpoint", str(jury_checkpoint), "--drafter-heads", "head0,head7"]
    assert trunk_main(argv) == 2
    assert "--drafter-heads: ['head7'] are not llm heads" in capsys.readouterr().err
    # A port in use is an error, not a second service sharing the port (SO_REUSEPORT).
    assert trunk_main(["--checkpoint", str(jury_checkpoint), "--listen", trunk.address]) == 2
    assert f"trunk service: error: Failed to bind to address {trunk.address}" in (
        capsys.readouterr().err
    )


def test_services_run_from_the_command_line_and_stop_on_sigterm(jury_checkpoint):
    common = ["--checkpoint", str(jury_checkpoint), "--listen", "127.0.0.1:0"]
    python = [sys.executable, "-m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = {
        "trunk": start_child(
            "trunk", [*python, "trunk_service", *common, "--drafter-heads", "head0,head1"], 30, env
        ),
        "jury": start_child(
            "jury",
            [*python, "jury_service", *common, "--heads", "head2,head3", "--grace-s", "1"],
            30,
            env,
        ),
    }
    try:
        for name, child in children.items():
            assert child.address.startswith("127.0.0.1:"), child.failure
            with grpc.insecure_channel(child.address) as channel:
                if name == "trunk":
                    info = internal_pb2_grpc.TrunkStub(channel).Info(internal_pb2.InfoRequest())
                    assert list(info.drafter_heads) == ["head0", "head1"]
                else:
                    info = internal_pb2_grpc.JuryStub(channel).Info(internal_pb2.InfoRequest())
                    assert list(info.hosted_heads) == ["head2", "head3"]
                assert info.model.vocab_size == 32
        for child in children.values():
            child.process.send_signal(signal.SIGTERM)
        for child in children.values():
            assert child.process.wait(timeout=10) == 0
    finally:
        for child in children.values():
            if child.process.poll() is None:
                child.process.kill()


# --- Errors that are bugs, and the event loop ------------------------------------------


def test_a_bug_is_internal_and_logged_never_the_callers_fault(trunk, caplog):
    def broken(call):
        raise IndexError("index 9 is out of bounds for dimension 0 with size 4")

    trunk.servicer.worker.draft = broken
    trunk.stub.Prefill(prefill_request())
    with caplog.at_level("ERROR", logger="hydra_jury"):
        assert_error(
            trunk.stub.Draft, draft_request(), Code.INTERNAL, r"internal error \(IndexError\)"
        )
    assert any(record.exc_info for record in caplog.records), "no traceback was logged"


def test_info_does_not_reread_the_checkpoint(tmp_path, jury_checkpoint, background_loop):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(jury_checkpoint, checkpoint)
    running = background_loop.run(serve_worker(TRUNK_SERVICE, ServiceOptions(checkpoint)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = internal_pb2_grpc.TrunkStub(channel)
            before = stub.Info(internal_pb2.InfoRequest(), timeout=10).model.fingerprint
            (checkpoint / "hydra.json").unlink()
            assert stub.Info(internal_pb2.InfoRequest(), timeout=10).model.fingerprint == before
    finally:
        background_loop.run(running.stop())


def test_tensors_are_encoded_and_decoded_off_the_event_loop(
    trunk, jury, background_loop, monkeypatch
):
    threads = []

    def recording(function):
        def wrapper(*args):
            threads.append(threading.current_thread())
            return function(*args)

        return wrapper

    for name in ("draft_result_to_pb", "score_call_from_pb", "score_result_to_pb"):
        monkeypatch.setattr(wire, name, recording(getattr(wire, name)))
    trunk.stub.Prefill(prefill_request())
    trunk.stub.Draft(draft_request())
    jury.stub.Prefill(jury_prefill_request(positions=2))
    jury.stub.Score(score_request(start=2))
    assert len(threads) == 3
    assert background_loop.thread not in threads
