"""What every worker service shares, through real trunk and jury services: Info,
health, reflection, epochs and release, idle eviction, the command line, INTERNAL for
bugs, and tensors converted off the event loop."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hydra_jury.orchestrator.launcher import LocalStack, start_child
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from hydra_jury.serving import internal_wire as wire
from hydra_jury.serving.worker_service import ServiceOptions, serve_worker, service_main
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from tests.worker_services import (
    assert_error,
    draft_request,
    jury_prefill_request,
    prefill_request,
    score_request,
)

Code = grpc.StatusCode


def trunk_main(argv: list[str]) -> int:
    return service_main(TRUNK_SERVICE, argv)


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
    turn = str(tmp_path / "missing" / "host.turn")
    assert trunk_main(["--checkpoint", str(jury_checkpoint), "--host-turn", turn]) == 2
    assert "--host-turn: cannot open the lock file" in capsys.readouterr().err


def test_the_local_stack_gives_its_services_one_host_turn(jury_checkpoint, monkeypatch):
    """The local stack's trunk and shards share the host's cores: they name one lock file,
    removed when the stack stops; placed on cores of their own, they name none."""
    commands = {}

    def spawn(stack, name, command, timeout_s):
        commands[name] = command
        return "127.0.0.1:1"

    monkeypatch.setattr(LocalStack, "_spawn", spawn)
    stack = LocalStack(str(jury_checkpoint), shards=2, redis_url="redis://127.0.0.1:1/0")
    stack.start()
    turns = {
        name: command[command.index("--host-turn") + 1]
        for name, command in commands.items()
        if "--host-turn" in command
    }
    assert sorted(turns) == ["jury0", "jury1", "trunk"] and len(set(turns.values())) == 1
    assert os.path.exists(turns["trunk"])
    stack.stop()
    assert not os.path.exists(turns["trunk"])
    commands.clear()
    placed = {"trunk": "0", "jury0": "1", "jury1": "1", "orchestrator": "1"}
    LocalStack(str(jury_checkpoint), redis_url="redis://127.0.0.1:1/0", cpus=placed).start()
    assert commands and not any("--host-turn" in command for command in commands.values())


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


def test_a_bug_is_internal_and_logged_never_the_callers_fault(trunk, caplog):
    def broken(*args):
        raise IndexError("index 9 is out of bounds for dimension 0 with size 4")

    trunk.stub.Prefill(prefill_request())
    trunk.servicer.worker._trunk_steps = broken  # deep inside a (stepped) draft call
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
