"""Running the stack as processes: the launcher, the CLI client, configuration, start-up
refusals and graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from hydra_jury.cli import main
from hydra_jury.orchestrator.__main__ import main as orchestrator_main
from hydra_jury.orchestrator.config import REDIS_URL_VARIABLE, ConfigFileError, OrchestratorConfig
from hydra_jury.orchestrator.convert import request_from_pb, request_to_pb
from hydra_jury.orchestrator.launcher import OPENMP_WAIT_VARIABLES, LocalStack, start_child
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.redis_store import RedisStore
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc
from tests.grpc_stack import Stack


@pytest.fixture(autouse=True)
def no_redis_url_variable(monkeypatch):
    """The tests name their Redis (or none) themselves, whatever the environment holds."""
    monkeypatch.delenv(REDIS_URL_VARIABLE, raising=False)


def answers(port: int) -> bool:
    """Whether something accepts connections on the loopback port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def http_completion(url: str, model: str, prompt: str, max_tokens: int, **options) -> dict:
    """POST /v1/completions at the HTTP API `url`: the answer's JSON."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **options}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def test_request_messages_round_trip():
    for request in (
        GenerationRequest(
            prompt="hi",
            max_new_tokens=9,
            stop=["x"],
            gamma=2,
            rule="lenient",
            lenience=0.5,
            beta=2.0,
            temperature=0.0,
            top_k=3,
            top_p=0.5,
            min_p=0.1,
            epsilon=0.02,
            seed=5,
            draft_head="head1",
            jury=["head0"],
        ),
        GenerationRequest(messages=[{"role": "user", "content": "yo"}], ignore_eos=True),
    ):
        assert request_from_pb(request_to_pb(request)) == request


def test_config_file_and_flags(tmp_path):
    path = tmp_path / "orchestrator.yaml"
    path.write_text(
        "checkpoint: ckpt\ntrunk: 127.0.0.1:1\njury: [127.0.0.1:2, 127.0.0.1:3]\n"
        "metrics_port: 9100\nredis_url: redis://127.0.0.1:1/0\n"
    )
    config = OrchestratorConfig.load(path, {"trunk": "127.0.0.1:9", "jury": None})
    assert config.trunk == "127.0.0.1:9" and config.jury == ["127.0.0.1:2", "127.0.0.1:3"]
    assert config.metrics_port == 9100 and config.redis_url == "redis://127.0.0.1:1/0"
    path.write_text("checkpoint: ckpt\ntrunk: a\njury: [b]\nshards: 3\n")
    with pytest.raises(ConfigFileError, match=r"unknown settings \['shards'\]"):
        OrchestratorConfig.load(path, {})
    with pytest.raises(ConfigFileError, match="no jury shard addresses"):
        OrchestratorConfig.load(None, {"checkpoint": "c", "trunk": "t"})
    with pytest.raises(ConfigFileError, match="listed twice"):
        OrchestratorConfig.load(None, {"checkpoint": "c", "trunk": "t", "jury": "a,a"})


def test_the_orchestrator_sets_its_threads_once_it_is_up(monkeypatch):
    """`--threads` (else the default, None: one, or $OMP_NUM_THREADS) reaches
    `set_orchestrator_threads` once the server is up, and a bad count is refused first."""
    import hydra_jury.orchestrator.__main__ as entry
    import hydra_jury.orchestrator.server as server

    events = []

    class Running:
        async def serve_until_signal(self, *args):
            events.append("serving")

    async def serve_orchestrator(**options):
        events.append("started")
        return Running()

    monkeypatch.setattr(server, "serve_orchestrator", serve_orchestrator)
    monkeypatch.setattr(entry, "set_orchestrator_threads", lambda n: events.append(("threads", n)))
    argv = ["--checkpoint", "ckpt", "--trunk", "127.0.0.1:1", "--jury", "127.0.0.1:2"]
    argv += ["--redis-url", "redis://127.0.0.1:1/0"]
    assert orchestrator_main(argv) == 0
    assert events == ["started", ("threads", None), "serving"]
    events.clear()
    assert orchestrator_main([*argv, "--threads", "3"]) == 0
    assert events == ["started", ("threads", 3), "serving"]
    for bad in (0, True, "two"):
        with pytest.raises(ConfigFileError, match="threads must be a whole number of at least 1"):
            OrchestratorConfig.load(
                None,
                {
                    "checkpoint": "c",
                    "trunk": "t",
                    "jury": "j",
                    "redis_url": "redis://x",
                    "threads": bad,
                },
            )


def test_orchestrator_refuses_a_bad_layout(jury_checkpoint, redis_url, capsys):
    shards = [["head0", "head1"], ["head1", "head2", "head3"]]
    stack = Stack(str(jury_checkpoint), shards, redis_url).start_services()
    try:
        code = orchestrator_main(stack.orchestrator_argv())
        assert code == 2
        assert "'head1' is hosted by both" in capsys.readouterr().err
    finally:
        stack.close()


def test_orchestrator_refuses_to_start_without_redis(capsys):
    argv = ["--checkpoint", "ckpt", "--trunk", "127.0.0.1:1", "--jury", "127.0.0.1:2"]
    assert orchestrator_main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("orchestrator: error: redis_url is not set")
    assert "--redis-url" in error and REDIS_URL_VARIABLE in error


def test_local_stack_serves_the_cli_and_shuts_down_gracefully(jury_checkpoint, engine, capsys):
    stack = LocalStack(
        str(jury_checkpoint),
        shards=2,
        port=0,
        shard_threads=1,
        extra_service_args=["--max-session-tokens", "128"],
        http_listen="127.0.0.1:0",
        served_model_name="demo",
        log_format="json",
    )
    try:
        address = stack.start(timeout_s=120)
        argv = [
            "generate",
            "--address",
            address,
            "hi",
            "--no-chat",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--seed",
            "4",
            "--gamma",
            "3",
        ]
        # The launcher forwards each process's lines: the orchestrator's logs are JSON.
        logged = re.findall(r"^\[orchestrator\] (\{.*)$", capsys.readouterr().err, re.M)
        assert json.loads(logged[0])["logger"].startswith("hydra_jury")
        assert main([*argv, "--json"]) == 0
        response = json.loads(capsys.readouterr().out)
        expected = engine.generate(
            GenerationRequest(prompt="hi", max_new_tokens=12, ignore_eos=True, seed=4, gamma=3)
        )
        assert [int(t) for t in response["tokenIds"]] == expected.token_ids
        assert main(argv) == 0
        assert capsys.readouterr().out == expected.text + "\n"
        assert main([*argv, "--gamma", "0"]) == 2
        assert "INVALID_ARGUMENT: gamma" in capsys.readouterr().err
        # The orchestrator's HTTP API, where its line says: the same tokens.
        url = re.fullmatch(r", HTTP API on (http://127\.0\.0\.1:\d+)", stack.http_detail)[1]
        options = {"seed": 4, "hydra": {"ignore_eos": True, "gamma": 3}}
        completion = http_completion(url, "demo", "hi", 12, **options)  # the served name
        assert completion["choices"][0]["text"] == expected.text
        assert stack.redis is not None and stack.sessions_url == stack.redis.url
        assert answers(stack.redis.port)
        if sys.platform == "linux":  # every process was started with the stack's log format
            for child in stack.children:
                argv = Path(f"/proc/{child.process.pid}/cmdline").read_bytes()
                assert b"\0--log-format\0json\0" in argv, child.name
        if sys.platform == "linux" and not set(OPENMP_WAIT_VARIABLES) & set(os.environ):
            # what each process was really started with
            for child in stack.children:
                started = Path(f"/proc/{child.process.pid}/environ").read_bytes().split(b"\0")
                waiting = (
                    {b"GOMP_SPINCOUNT=30000"}
                    if child.name == "trunk"
                    else {b"OMP_WAIT_POLICY=PASSIVE"}
                )
                assert waiting <= set(started), child.name
    finally:
        codes = stack.stop()
    assert codes == {"trunk": 0, "jury0": 0, "jury1": 0, "orchestrator": 0}
    assert not answers(stack.redis.port)  # its private Redis stopped with it


def test_local_stack_keeps_its_sessions_in_the_redis_it_is_given(jury_checkpoint, redis_url):
    """... and runs a child on the CPUs it is given (`cpus`), the others anywhere; a
    second orchestrator over the same services (`add_orchestrator`, as the latency
    benchmark starts one per hop delay) is placed as the first and gives its tokens."""
    with pytest.raises(RuntimeError, match="has not started"):
        LocalStack(str(jury_checkpoint)).add_orchestrator([])
    stack = LocalStack(
        str(jury_checkpoint),
        shards=1,
        port=0,
        redis_url=redis_url,
        cpus={"jury0": "0", "orchestrator": "0"},
    )
    request = request_to_pb(
        GenerationRequest(prompt="hi", max_new_tokens=3, ignore_eos=True, temperature=0.0)
    )
    try:
        address = stack.start(timeout_s=120)
        delayed = stack.add_orchestrator(["--inject-hop-delay-ms", "1"], timeout_s=120)
        assert stack.redis is None  # nothing of its own to start
        affinity = {c.name: os.sched_getaffinity(c.process.pid) for c in stack.children}
        assert affinity["jury0"] == affinity["orchestrator"] == affinity["orchestrator1"] == {0}
        assert affinity["trunk"] == os.sched_getaffinity(0)
        tokens = []
        for served in (address, delayed):
            with grpc.insecure_channel(served) as channel:
                response = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
                tokens.append(list(response.token_ids))
        assert len(tokens[0]) == 3 and tokens[1] == tokens[0]
    finally:
        codes = stack.stop()
    assert codes == {"trunk": 0, "jury0": 0, "orchestrator": 0, "orchestrator1": 0}
    assert stack.services == []

    async def stored() -> bool:
        store = RedisStore(redis_url)  # the orchestrator's default key prefix
        try:
            return await store.load(response.session_id) is not None
        finally:
            await store.close()

    assert asyncio.run(stored())


def test_a_silent_hung_child_does_not_block_the_launcher():
    """A child that never prints (hung before logging anything) fails the start-up after
    the timeout, and is killed; it does not block `hydra-jury up` forever."""
    began = time.monotonic()
    silent = start_child("silent", [sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert time.monotonic() - began < 10
    assert not silent.address and "did not start within 1 s" in silent.failure
    assert silent.process.poll() is not None  # killed
    crashed = start_child("crashed", [sys.executable, "-c", "raise SystemExit(3)"], 30.0)
    assert "did not start (exit code 3)" in crashed.failure


def test_the_single_process_server_runs_from_the_command_line(jury_checkpoint, engine, capsys):
    command = [
        *(sys.executable, "-m", "hydra_jury.cli", "serve"),
        *("--checkpoint", str(jury_checkpoint), "--listen", "127.0.0.1:0"),
        *("--max-session-tokens", "128", "--threads", "1", "--http-listen", "127.0.0.1:0"),
    ]
    server = start_child("server", command, 60.0)
    try:
        assert server.address, server.failure
        url = re.search(r"HTTP API on (http://127\.0\.0\.1:\d+)", server.line)[1]
        # Without a Redis named, it started its own, and says where.
        redis_port = int(
            re.search(r"sessions in Redis at redis://127\.0\.0\.1:(\d+)/", capsys.readouterr().err)[
                1
            ]
        )
        assert answers(redis_port)
        with grpc.insecure_channel(server.address) as channel:
            response = generation_pb2_grpc.GenerationStub(channel).Generate(
                request_to_pb(GenerationRequest(prompt="hi", max_new_tokens=10, seed=4)),
                timeout=30,
            )
        expected = engine.generate(GenerationRequest(prompt="hi", max_new_tokens=10, seed=4))
        assert list(response.token_ids) == expected.token_ids
        completion = http_completion(url, jury_checkpoint.name, "hi", 10, seed=4)
        assert completion["choices"][0]["text"] == expected.text
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=15) == 0
        assert not answers(redis_port)
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_the_single_process_server_refuses_bad_session_settings(jury_checkpoint, capsys):
    argv = ["serve", "--checkpoint", str(jury_checkpoint), "--session-lease-s", "0"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "hydra-jury serve: error: session lease must be positive and at most the TTL, got 0.0\n"
    )


def test_the_trunk_spins_briefly_and_the_rest_of_the_stack_waits_passively(
    monkeypatch, jury_checkpoint
):
    stack = LocalStack(str(jury_checkpoint))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    trunk = stack.environment("trunk")
    assert trunk["GOMP_SPINCOUNT"] == "30000" and "OMP_WAIT_POLICY" not in trunk
    for child in ("jury0", "jury1", "orchestrator"):
        environment = stack.environment(child)
        assert environment["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in environment
    # The caller's own setting wins, for every child.
    for variable, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "5")):
        with monkeypatch.context() as patched:
            patched.setenv(variable, value)
            for child in ("trunk", "jury0", "orchestrator"):
                environment = stack.environment(child)
                assert environment[variable] == value
                assert set(environment) - set(os.environ) == set()
