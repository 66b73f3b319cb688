"""Overload (issue 25): the split stack as real processes on loopback (one orchestrator,
a trunk service, two jury shards, Redis), each service admitting `--admitted` sessions
at once and the orchestrator as many generations, driven by `--factor` times as many
closed-loop clients for `--seconds`. Each request is a seeded generation on its own
session (create, generate, close) with a deadline.

Checked: every request completes or is refused with RESOURCE_EXHAUSTED, the refusals
within `REFUSAL_P99_S` (p99); the resident memory of every process after the load is
within `RSS_GROWTH` of what it was after a warm-up of the same load; once the load stops
and its sessions are closed, no service holds a session (Info's active_sessions). Some
requests must complete and some be refused: a load never refused was queued.
Prints a Markdown table per process and per outcome; the exit status is 1 if a property
does not hold.

    .venv/bin/python -m tools.overload [--seconds 60] [--factor 4] [--admitted 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hydra_jury.orchestrator.client import GenerationClient, RetryPolicy
from hydra_jury.protos.hydrajury.v1 import internal_pb2, internal_pb2_grpc
from tools.chaos import tiny_checkpoint
from tools.chaos_stack import SERVICE_FLAGS, ChaosStack
from tools.chaos_workload import request

REFUSAL_P99_S = 1.0  # "quickly": a refused client knows within this
RSS_GROWTH = 0.10  # of the RSS after the warm-up
REQUEST_TIMEOUT_S = 30.0
SLOTS_FREED_WITHIN_S = 5.0  # Release calls still in flight when the load stops
# Refusals are the point: a client that retried them would hide them.
NO_RETRY = RetryPolicy(attempts=1)
# By the name `ChaosStack` gives the process.
SERVICE_STUBS = {"trunk": internal_pb2_grpc.TrunkStub, "jury": internal_pb2_grpc.JuryStub}


@dataclass
class Outcomes:
    completed: list[float] = field(default_factory=list)  # latencies, s
    refused: list[float] = field(default_factory=list)
    failed: Counter = field(default_factory=Counter)  # by status code (and the call)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def requests(self) -> int:
        return len(self.completed) + len(self.refused) + sum(self.failed.values())


def client_loop(address: str, index: int, args: argparse.Namespace, until: float) -> Outcomes:
    """Requests back to back until `until`: each a new session, one generation, closed."""
    outcomes = Outcomes()
    with GenerationClient(address, timeout_s=REQUEST_TIMEOUT_S, retry=NO_RETRY) as client:
        for number in range(sys.maxsize):
            if time.monotonic() >= until:
                break
            began = time.monotonic()
            step = "create"
            try:
                session = client.create_session()
                step = "generate"
                try:
                    client.generate(request(index, number, session, args.new_tokens))
                    outcomes.completed.append(time.monotonic() - began)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    outcomes.refused.append(time.monotonic() - began)
                step = "close"
                client.close_session(session)
            except grpc.RpcError as error:
                outcomes.failed[f"{step}: {error.code().name}"] += 1
    return outcomes


def load(address: str, args: argparse.Namespace, seconds: float) -> Outcomes:
    """`--factor` x `--admitted` clients in a closed loop for `seconds`."""
    until = time.monotonic() + seconds
    clients = args.factor * args.admitted
    with ThreadPoolExecutor(clients) as pool:
        runs = [pool.submit(client_loop, address, i, args, until) for i in range(clients)]
        total = Outcomes()
        for run in runs:
            outcomes = run.result()
            total.completed += outcomes.completed
            total.refused += outcomes.refused
            total.failed += outcomes.failed
    return total


def rss_kib(pid: int) -> int:
    """Resident memory of `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def stack_rss(stack: ChaosStack) -> dict[str, int]:
    return {name: rss_kib(p.child.process.pid) for name, p in stack.processes.items()}


def active_sessions(stack: ChaosStack) -> dict[str, int]:
    """Sessions each service holds now (Info's limits.active_sessions)."""
    held = {}
    for name, process in stack.processes.items():
        stub = next((s for kind, s in SERVICE_STUBS.items() if name.startswith(kind)), None)
        if stub is not None:
            with grpc.insecure_channel(process.address) as channel:
                info = stub(channel).Info(internal_pb2.InfoRequest(), timeout=10.0)
            held[name] = info.limits.active_sessions
    return held


def sessions_after_load(stack: ChaosStack) -> dict[str, int]:
    """Active sessions per service, waiting up to `SLOTS_FREED_WITHIN_S` for them to
    reach 0."""
    deadline = time.monotonic() + SLOTS_FREED_WITHIN_S
    while True:
        held = active_sessions(stack)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[-1]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def report(
    outcomes: Outcomes, before: dict[str, int], after: dict[str, int], held: dict[str, int]
) -> tuple[str, bool]:
    """The tables, and whether every property held."""
    failed = ", ".join(f"{n} {code}" for code, n in sorted(outcomes.failed.items()))
    refusals_quick = p99(outcomes.refused) < REFUSAL_P99_S
    requests = table(
        ["requests", "completed", "p99 s", "RESOURCE_EXHAUSTED", "p99 s", "failed"],
        [
            [
                str(outcomes.requests),
                str(len(outcomes.completed)),
                f"{p99(outcomes.completed):.2f}",
                str(len(outcomes.refused)),
                f"{p99(outcomes.refused):.2f}" + ("" if refusals_quick else " (slow)"),
                failed or "0",
            ]
        ],
    )
    flat = {name: after[name] <= before[name] * (1 + RSS_GROWTH) for name in before}
    processes = table(
        ["process", "RSS after warm-up MiB", "RSS after load MiB", "growth", "sessions held"],
        [
            [
                name,
                f"{before[name] / 1024:.0f}",
                f"{after[name] / 1024:.0f}",
                f"{after[name] / before[name] - 1:+.1%}" + ("" if flat[name] else " (grew)"),
                str(held.get(name, "-")),
            ]
            for name in before
        ],
    )
    ok = (
        not outcomes.failed
        and outcomes.completed
        and outcomes.refused
        and refusals_quick
        and all(flat.values())
        and not any(held.values())
    )
    return f"{requests}\n\n{processes}", bool(ok)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.overload", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="of load (%(default)g)")
    parser.add_argument("--warmup", type=float, default=10.0, help="s before RSS (%(default)g)")
    parser.add_argument("--factor", type=int, default=4, help="clients per admitted one")
    parser.add_argument(
        "--admitted",
        type=int,
        default=2,
        help="sessions each service and generations the orchestrator admit (%(default)s)",
    )
    parser.add_argument("--new-tokens", type=int, default=16, help="per request (%(default)s)")
    parser.add_argument("--checkpoint", type=Path, help="default: a tiny random one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="overload-") as scratch:
        checkpoint = args.checkpoint or tiny_checkpoint(Path(scratch))
        admitted = str(args.admitted)
        service_flags = [*SERVICE_FLAGS]
        service_flags[service_flags.index("--max-sessions") + 1] = admitted
        stack = ChaosStack(
            checkpoint,
            Path(scratch),
            trunk_replicas=1,
            shard_replicas=1,
            orchestrators=1,
            service_flags=service_flags,
            orchestrator_flags=["--max-concurrency", admitted],
        )
        try:
            stack.start()
            address = stack.address("orchestrator0")
            load(address, args, args.warmup)
            before = stack_rss(stack)
            outcomes = load(address, args, args.seconds)
            held = sessions_after_load(stack)
            after = stack_rss(stack)
        finally:
            stack.stop()
    text, ok = report(outcomes, before, after, held)
    print(f"{args.factor * args.admitted} clients, {args.admitted} admitted, {args.seconds:g} s")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
