"""The split stack of `tools.chaos` as real processes on loopback, each of which can be
killed with SIGKILL and started again on the same port: trunk replicas, jury shards of
several replicas, orchestrators (static discovery naming every replica) and Redis, with
the append-only file on or off."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hydra_jury.hydra_model.checkpoint import read_manifest
from hydra_jury.orchestrator.discovery import REPLICA_SEPARATOR
from hydra_jury.orchestrator.launcher import Child, start_child
from hydra_jury.orchestrator.sessions.redis_server import LocalRedis, free_port

START_TIMEOUT_S = 120.0
# Small and light: every process shares 2 cores with the rest.
SERVICE_FLAGS = ["--threads", "1", "--max-sessions", "16", "--max-session-tokens", "256"]


@dataclass
class Process:
    name: str
    command: list[str]  # with its fixed --listen port, so a restart keeps the address
    address: str
    child: Child | None = None


@dataclass
class ChaosStack:
    checkpoint: Path
    data_dir: Path  # Redis's append-only file
    trunk_replicas: int = 2
    shards: int = 2
    shard_replicas: int = 2
    orchestrators: int = 2
    lease_s: float = 1.0
    service_flags: list[str] = field(default_factory=lambda: list(SERVICE_FLAGS))
    orchestrator_flags: list[str] = field(default_factory=list)
    processes: dict[str, Process] = field(default_factory=dict)
    redis: LocalRedis | None = None

    def start(self) -> ChaosStack:
        self.redis = LocalRedis(data_dir=self.data_dir).start()
        heads = [h.name for h in read_manifest(self.checkpoint).llm_heads]
        python = [sys.executable, "-m"]
        trunks = [
            self._process(f"trunk{r}", [*python, "hydra_jury.trunk_service"])
            for r in range(self.trunk_replicas)
        ]
        shards = [
            [
                self._process(
                    f"jury{s}.{r}",
                    [
                        *python,
                        "hydra_jury.jury_service",
                        "--heads",
                        ",".join(heads[s :: self.shards]),
                    ],
                )
                for r in range(self.shard_replicas)
            ]
            for s in range(self.shards)
        ]
        services = [*trunks, *(p for shard in shards for p in shard)]
        self._start_all(services, self.service_flags)
        jury = ",".join(REPLICA_SEPARATOR.join(p.address for p in shard) for shard in shards)
        orchestrator = [
            *python,
            "hydra_jury.orchestrator",
            *("--trunk", REPLICA_SEPARATOR.join(p.address for p in trunks), "--jury", jury),
            *("--redis-url", self.redis.url, "--session-lease-s", str(self.lease_s)),
        ]
        orchestrators = [
            self._process(f"orchestrator{o}", orchestrator) for o in range(self.orchestrators)
        ]
        self._start_all(orchestrators, self.orchestrator_flags)
        return self

    def _process(self, name: str, command: list[str]) -> Process:
        address = f"127.0.0.1:{free_port()}"
        command = [*command, "--checkpoint", str(self.checkpoint), "--listen", address]
        process = Process(name, command, address)
        self.processes[name] = process
        return process

    def _start_all(self, processes: list[Process], flags: list[str]) -> None:
        """Starts `processes` at once (each loads the model: in turn would take long)."""
        for process in processes:
            process.command += flags
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(self.restart, [p.name for p in processes]))

    def address(self, name: str) -> str:
        return self.processes[name].address

    def kill(self, name: str) -> None:
        """SIGKILL, as if its machine died."""
        child = self.processes[name].child
        if child is not None and child.process.poll() is None:
            child.process.kill()
            child.process.wait()

    def restart(self, name: str) -> None:
        """Starts `name` (again) on its address; waits until it listens."""
        process = self.processes[name]
        process.child = start_child(name, process.command, START_TIMEOUT_S)
        if not process.child.address:
            raise RuntimeError(process.child.failure)

    def kill_redis(self) -> None:
        self.redis.kill()

    def restart_redis(self, persistent: bool) -> None:
        """Redis again on its port: reading its append-only file (`persistent`), else
        empty and without one, as a Redis that keeps nothing on disk."""
        data_dir = self.data_dir if persistent else None
        self.redis = LocalRedis(port=self.redis.port, data_dir=data_dir).start()

    def stop(self) -> None:
        for name in reversed(list(self.processes)):  # the orchestrators first
            self.kill(name)
        if self.redis is not None:
            self.redis.stop()
