"""The local stack for development (`make run`, `hydra-jury up`): a trunk service, jury
shards splitting the heads, and the orchestrator, as separate processes on loopback,
with the sessions in a private `redis-server` (or a Redis the caller names). Each child
is started, its "listening on" line awaited, and all are stopped together (SIGTERM,
then SIGKILL after a grace period; the private Redis last, after the orchestrator's
final writes) when this process is interrupted or one child dies. With certificates
(`tls`), the services' ports are mTLS, the orchestrator connects to them with its client
certificate and serves the Generation API over TLS."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from hydra_jury.hydra_model.checkpoint import read_manifest
from hydra_jury.orchestrator.sessions.redis_server import LocalRedis
from hydra_jury.serving.logs import LOG_FORMATS
from hydra_jury.serving.tls import CertificateDirectory

LISTENING = re.compile(r"listening on (\S+?):(\d+)")
HTTP_API = re.compile(r"HTTP API on ([^,\s]+)")  # on the orchestrator's line, with one

# How the stack's processes wait between OpenMP parallel regions, since they share the
# host (docs/benchmarks.md, "One host"). They take turns (draft, score, accept), and a process whose
# threads spin while it waits takes a core from the one working: with libgomp's default
# (about 3.5 ms of spinning after every region on the development machine) the split
# stack ran at 10.2 tokens/s. The shards (which score at the same time) and the
# orchestrator wait passively. The trunk spins briefly: a draft is γ sequential trunk
# steps of hundreds of short parallel regions each, and a kernel wake-up of its threads
# before every region made a passive trunk's draft of 4 tokens take 197 ms instead of 130
# (2-core machine). 30,000 spins (about 0.35 ms) bridge the gaps inside a step and the
# service's hop between steps, and end soon after the draft does: split stack / single-
# process server 0.64x → 0.84x (speculative γ=4), 0.72x → 0.85-0.88x (non-speculative).
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a caller's setting wins
OPENMP_WAITING = {
    "trunk": {"GOMP_SPINCOUNT": "30000"},
    "other": {"OMP_WAIT_POLICY": "PASSIVE"},
}


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    address: str = ""  # HOST:PORT once it printed its "listening on" line
    line: str = ""  # that line
    failure: str = ""  # why it did not start


def start_child(
    name: str, command: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> Child:
    """Starts `command` and waits for its "listening on HOST:PORT" line on stderr.

    A reader thread forwards every line (prefixed with the name) and keeps draining the
    pipe for the child's whole life, so a chatty child never blocks on a full pipe and
    a silent one cannot block the wait: after `timeout_s` without the line, or when the
    child exits first, the child is killed and `failure` says what happened."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    child = Child(name, process)
    listening = queue.Queue()

    def forward() -> None:
        for line in process.stderr:
            print(f"[{name}] {line}", end="", file=sys.stderr, flush=True)
            match = LISTENING.search(line)
            if match and listening.empty():
                listening.put((f"{match[1]}:{match[2]}", line))
        listening.put(("", ""))  # end of output: the child has exited

    threading.Thread(target=forward, daemon=True).start()
    try:
        child.address, child.line = listening.get(timeout=timeout_s)
    except queue.Empty:
        child.failure = f"{name} did not start within {timeout_s:g} s; see its output above"
    else:
        if not child.address:
            code = process.wait()
            child.failure = f"{name} did not start (exit code {code}); see its output above"
    if not child.address and process.poll() is None:
        process.kill()
        process.wait()
    return child


@dataclass
class LocalStack:
    checkpoint: str
    shards: int = 2
    host: str = "127.0.0.1"
    port: int = 50050  # orchestrator; services take the next ports (0 everywhere: any free)
    metrics_port: int | None = None
    extra_service_args: list[str] = field(default_factory=list)
    shard_threads: int | None = None  # CPU threads of each jury shard (default: torch's)
    redis_url: str | None = None  # the sessions' Redis; None: a private one per start
    draft_model: str | None = None  # the trunk's draft model (a Hydra checkpoint)
    tls: CertificateDirectory | None = None  # None: plaintext everywhere
    http_listen: str | None = None  # the orchestrator's HTTP API (None: off)
    served_model_name: str | None = None  # its model name (None: the checkpoint's)
    orchestrator_args: list[str] = field(default_factory=list)  # e.g. --api-keys FILE
    log_format: str = LOG_FORMATS[0]  # every process's --log-format
    # Every process's --otlp-endpoint (None: each reads the OTEL_* variables it inherits)
    otlp_endpoint: str | None = None
    # Child name ("trunk", "jury0", ..., "orchestrator") -> the CPUs it runs on alone, as
    # `taskset -c` takes them ("0", "1-3"); benchmarks place processes as if each group
    # ran on a machine of its own. Unnamed children run anywhere.
    cpus: dict[str, str] = field(default_factory=dict)
    # The trunk and the shards take turns on the host's cores (`serving.host_turn`),
    # unless `cpus` gives them cores of their own.
    host_turn: bool = True
    children: list[Child] = field(default_factory=list)
    services: list[str] = field(default_factory=list)  # trunk, shards: addresses once started
    _turn_file: str | None = None  # the host turn's lock file, removed at `stop`
    redis: LocalRedis | None = None  # the private Redis, once started

    @property
    def sessions_url(self) -> str:
        """The Redis the orchestrator keeps its sessions in."""
        if self.redis_url is not None:
            return self.redis_url
        if self.redis is None:
            raise RuntimeError("the stack has not started")
        return self.redis.url

    @property
    def http_detail(self) -> str:
        """The HTTP API's URL as ", HTTP API on URL", once the orchestrator said it serves
        one (on its listening line); "" without one."""
        for child in self.children:
            match = HTTP_API.search(child.line) if child.name == "orchestrator" else None
            if match:
                return f", HTTP API on {match[1]}"
        return ""

    def _port(self, offset: int) -> int:
        return 0 if self.port == 0 else self.port + offset

    def start(self, timeout_s: float = 300.0) -> str:
        """Starts every process; returns the orchestrator's address. A failed start stops
        what it started."""
        heads = [h.name for h in read_manifest(self.checkpoint).llm_heads]
        if not 1 <= self.shards <= len(heads):
            raise ValueError(f"--shards must be between 1 and the {len(heads)} heads")
        try:
            return self._start(heads, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, heads: list[str], timeout_s: float) -> str:
        if self.redis_url is None:
            self.redis = LocalRedis().start()
        turn = []
        if self.host_turn and not self.cpus:
            handle, self._turn_file = tempfile.mkstemp(prefix="hydra-jury-", suffix=".turn")
            os.close(handle)
            turn = ["--host-turn", self._turn_file]
        trunk = self._spawn(
            "trunk",
            self.command(
                "hydra_jury.trunk_service",
                "--listen",
                f"{self.host}:{self._port(1)}",
                *(["--draft-model", self.draft_model] if self.draft_model else []),
                *self._service_tls_args(),
                *turn,
                *self.extra_service_args,
            ),
            timeout_s,
        )
        groups = [heads[i :: self.shards] for i in range(self.shards)]
        shards = [
            self._spawn(
                f"jury{i}",
                self.command(
                    "hydra_jury.jury_service",
                    "--heads",
                    ",".join(group),
                    "--listen",
                    f"{self.host}:{self._port(2 + i)}",
                    *self._service_tls_args(),
                    *turn,
                    *self.extra_service_args,
                    *(["--threads", str(self.shard_threads)] if self.shard_threads else []),
                ),
                timeout_s,
            )
            for i, group in enumerate(groups)
        ]
        self.services = [trunk, *shards]
        command = self._orchestrator_command(self.port, self.orchestrator_args)
        if self.metrics_port is not None:
            command += ["--metrics-port", str(self.metrics_port)]
        if self.http_listen is not None:
            command += ["--http-listen", self.http_listen]
        if self.served_model_name is not None:
            command += ["--served-model-name", self.served_model_name]
        return self._spawn("orchestrator", command, timeout_s)

    def add_orchestrator(self, args: list[str], timeout_s: float = 300.0) -> str:
        """Starts one more orchestrator over the started stack's services and Redis, with
        `args` in place of `orchestrator_args` (no metrics port or HTTP API: those are the
        first one's), on any free port and the CPUs `cpus` gives "orchestrator"; returns
        its address. Benchmarks compare orchestrator settings (a hop delay, pipelining)
        on one set of services, whose processes then differ in nothing between them."""
        if not self.services:
            raise RuntimeError("the stack has not started")
        started = sum(child.name.startswith("orchestrator") for child in self.children)
        command = self._orchestrator_command(0, args)
        return self._spawn(f"orchestrator{started}", command, timeout_s, placed_as="orchestrator")

    def _orchestrator_command(self, port: int, args: list[str]) -> list[str]:
        trunk, *shards = self.services
        return [
            *self.command(
                "hydra_jury.orchestrator",
                *("--trunk", trunk, "--jury", ",".join(shards)),
                *("--listen", f"{self.host}:{port}", "--redis-url", self.sessions_url),
            ),
            *self._orchestrator_tls_args(),
            *args,
        ]

    def command(self, module: str, *args: str) -> list[str]:
        """The command line of a child: `python -m module` with the stack's checkpoint,
        `args`, and the settings every process of the stack shares."""
        tracing = ["--otlp-endpoint", self.otlp_endpoint] if self.otlp_endpoint else []
        return [
            *(sys.executable, "-m", module, "--checkpoint", self.checkpoint, *args),
            *("--log-format", self.log_format, *tracing),
        ]

    def _service_tls_args(self) -> list[str]:
        """mTLS: the stack's server certificate, and only clients its CA signed."""
        if self.tls is None:
            return []
        return [
            *("--tls-cert", str(self.tls.server_cert), "--tls-key", str(self.tls.server_key)),
            *("--tls-ca", str(self.tls.ca)),
        ]

    def _orchestrator_tls_args(self) -> list[str]:
        """TLS on the Generation API (any client that trusts the CA), and the client
        certificate for the services. The services are verified as `localhost`, a name
        their certificate carries whatever address `host` is."""
        if self.tls is None:
            return []
        return [
            *("--tls-cert", str(self.tls.server_cert), "--tls-key", str(self.tls.server_key)),
            *("--internal-tls-ca", str(self.tls.ca)),
            *("--internal-tls-cert", str(self.tls.client_cert)),
            *("--internal-tls-key", str(self.tls.client_key)),
            *("--internal-tls-server-name", "localhost"),
        ]

    def environment(self, child: str) -> dict[str, str]:
        """The environment of the child named `child` ("trunk", "jury0", ...,
        "orchestrator"): this one, with how its OpenMP threads wait between parallel
        regions (`OPENMP_WAITING`) unless the caller's environment sets one of
        `OPENMP_WAIT_VARIABLES`."""
        if any(name in os.environ for name in OPENMP_WAIT_VARIABLES):
            return dict(os.environ)
        return {**os.environ, **OPENMP_WAITING["trunk" if child == "trunk" else "other"]}

    def _spawn(
        self, name: str, command: list[str], timeout_s: float, placed_as: str | None = None
    ) -> str:
        """Starts the child `name`, on the CPUs `cpus` gives it (or gives `placed_as`)."""
        placed_as = placed_as or name
        if placed_as in self.cpus:
            command = ["taskset", "-c", self.cpus[placed_as], *command]
        child = start_child(name, command, timeout_s, self.environment(placed_as))
        self.children.append(child)
        if not child.address:
            raise RuntimeError(child.failure)
        return child.address

    def wait(self) -> int:
        """Blocks until a child exits or this process is told to stop; returns its code."""
        stop = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.append(True))
        processes = [(child.name, child.process) for child in self.children]
        if self.redis is not None:
            processes.append(("redis-server", self.redis.process))
        while not stop:
            for name, process in processes:
                code = process.poll()
                if code is not None:
                    print(f"{name} exited with {code}", file=sys.stderr)
                    return code or 1
            time.sleep(0.2)
        return 0

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """Stops every child, then the private Redis; returns the children's exit codes
        (0: a graceful shutdown)."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        codes = {child.name: child.process.returncode for child in self.children}
        self.children.clear()
        self.services.clear()
        if self.redis is not None:
            self.redis.stop()
        if self._turn_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._turn_file)
            self._turn_file = None
        return codes
