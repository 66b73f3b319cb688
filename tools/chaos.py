"""`make chaos`: the split stack as real processes on loopback (2 orchestrators, 2 trunk
replicas, 2 jury shards of 2 replicas each, Redis with its append-only file), seeded
multi-turn sessions streamed through the resuming client, while each fault in turn hits
the stack: kill -9 (then a restart on the same port) of a trunk replica, a shard replica,
an orchestrator, Redis with the append-only file and Redis without one, and network
faults between the client and an orchestrator (a proxy that delays, resets with RST,
then drops connections). First the same sessions run without a fault: the reference.

Per fault it prints the turns (requests) completed, failed by status code, resumed
(attempts the client sent again), completed tokens identical to the reference, committed
rounds lost (received by a client, absent from the record: must be 0 unless Redis lost
its data), sessions lost, and the p95 latency of the turns that overlapped the fault.
Bounded: each phase starts no turn after `--seconds`, every call has a deadline; the exit
status is 1 if a fault lost a round it should keep or gave a token that differs.

    .venv/bin/python -m tools.chaos [--sessions 6] [--turns 3] [--seconds 40] [--short]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tools.chaos_stack import ChaosStack
from tools.chaos_workload import SessionRun, Turn, load_record, rounds_lost, run_session
from tools.fault_proxy import FaultProxy

FAULT_AFTER_S = 0.5  # into each phase, so that generations are in flight
FAULT_FOR_S = 3.0  # until the restart (or the end of the network faults)
NETWORK_DELAY_S = 0.05


@dataclass(frozen=True)
class Fault:
    name: str
    hit: Callable[[ChaosStack, FaultProxy], None]  # blocks for the fault, then heals
    loses_data: bool = False  # committed rounds may be lost (and that is expected)


def kill_and_restart(name: str) -> Callable[[ChaosStack, FaultProxy], None]:
    def hit(stack: ChaosStack, _proxy: FaultProxy) -> None:
        stack.kill(name)
        time.sleep(FAULT_FOR_S)
        stack.restart(name)

    return hit


def kill_redis(persistent: bool) -> Callable[[ChaosStack, FaultProxy], None]:
    def hit(stack: ChaosStack, _proxy: FaultProxy) -> None:
        stack.kill_redis()
        time.sleep(FAULT_FOR_S)
        stack.restart_redis(persistent)

    return hit


def network(_stack: ChaosStack, proxy: FaultProxy) -> None:
    """A third of the window each: every chunk delayed; then every connection reset; then
    every connection dropped (new ones closed at once)."""
    step = FAULT_FOR_S / 3
    proxy.delay_s = NETWORK_DELAY_S
    time.sleep(step)
    proxy.delay_s = 0.0
    proxy.reset_all()
    time.sleep(step)
    proxy.dropping = True
    time.sleep(step)
    proxy.dropping = False


def nothing(_stack: ChaosStack, _proxy: FaultProxy) -> None:
    return None


REFERENCE = Fault("none (reference)", nothing)
FAULTS = {
    "trunk": Fault("trunk replica kill -9", kill_and_restart("trunk0")),
    "shard": Fault("shard replica kill -9", kill_and_restart("jury0.0")),
    "orchestrator": Fault("orchestrator kill -9", kill_and_restart("orchestrator0")),
    "network": Fault("network: delay, RST, drop", network),
    "redis-aof": Fault("Redis kill -9, AOF on", kill_redis(persistent=True)),
    # Last: Redis keeps nothing on disk from then on.
    "redis": Fault("Redis kill -9, AOF off", kill_redis(persistent=False), loses_data=True),
}


@dataclass
class Phase:
    fault: Fault
    runs: list[SessionRun]
    window: tuple[float, float]  # when the fault began and was healed
    sessions_lost: int = 0
    lost: int = 0

    @property
    def turns(self) -> list[Turn]:
        return [turn for run in self.runs for turn in run.turns]


def run_phase(
    stack: ChaosStack, proxy: FaultProxy, fault: Fault, args: argparse.Namespace
) -> Phase:
    """The sessions, with `fault` after `FAULT_AFTER_S`. Even sessions call the
    orchestrator behind the proxy first, odd ones the other: both carry traffic."""
    direct, proxied = stack.address("orchestrator1"), proxy.address
    deadline = time.monotonic() + args.seconds
    with ThreadPoolExecutor(args.sessions) as pool:
        runs = [
            pool.submit(
                run_session,
                [proxied, direct] if index % 2 == 0 else [direct, proxied],
                stack.redis.url,
                index,
                args.turns,
                args.new_tokens,
                deadline,
            )
            for index in range(args.sessions)
        ]
        time.sleep(FAULT_AFTER_S)
        began = time.monotonic()
        fault.hit(stack, proxy)
        phase = Phase(fault, [run.result() for run in runs], (began, time.monotonic()))
    for run in phase.runs:
        gone = bool(run.session_id) and load_record(stack.redis.url, run.session_id) is None
        phase.sessions_lost += gone
        turns_lost = [rounds_lost(t.rounds, None) if gone else t.lost for t in run.turns]
        phase.lost += sum(turns_lost)
    return phase


def identical(phase: Phase, reference: Phase, resumed_only: bool = False) -> tuple[int, int]:
    """(completed turns with the reference's tokens, completed turns compared)."""
    expected = {(t.session, t.turn): t.token_ids for t in reference.turns if not t.error}
    compared = [
        t
        for t in phase.turns
        if not t.error and (t.session, t.turn) in expected and (t.resumed or not resumed_only)
    ]
    same = sum(t.token_ids == expected[(t.session, t.turn)] for t in compared)
    return same, len(compared)


def p95_s(phase: Phase) -> float:
    """Of the turns that overlapped the fault (all of them if none did)."""
    began, healed = phase.window
    during = [t for t in phase.turns if t.began <= healed and t.ended >= began and t.ended]
    latencies = sorted(t.ended - t.began for t in (during or phase.turns) if t.ended)
    if len(latencies) < 2:
        return latencies[0] if latencies else 0.0
    return statistics.quantiles(latencies, n=20, method="inclusive")[-1]


COLUMNS = (
    "fault",
    "requests",
    "completed",
    "failed",
    "resumed",
    "identical",
    "resumed identical",
    "rounds lost",
    "sessions lost",
    "p95 s",
)


def row(phase: Phase, reference: Phase) -> list[str]:
    failed = Counter(t.error for t in phase.turns if t.error)
    same, compared = identical(phase, reference)
    resumed_same, resumed = identical(phase, reference, resumed_only=True)
    return [
        phase.fault.name,
        str(len(phase.turns)),
        str(sum(not t.error for t in phase.turns)),
        ", ".join(f"{n} {code}" for code, n in sorted(failed.items())) or "0",
        str(sum(t.resumed for t in phase.turns)),
        f"{same}/{compared}",
        f"{resumed_same}/{resumed}",
        str(phase.lost),
        str(phase.sessions_lost),
        f"{p95_s(phase):.2f}",
    ]


def table(rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = [COLUMNS, ["---"] * len(COLUMNS), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def survived(phase: Phase, reference: Phase) -> bool:
    """Every completed token as in the reference; no committed round lost unless the
    fault takes the data with it."""
    same, compared = identical(phase, reference)
    return same == compared and (phase.fault.loses_data or phase.lost == 0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__)
    parser.add_argument("--sessions", type=int, default=6, help="concurrent (%(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="per session (%(default)s)")
    parser.add_argument("--new-tokens", type=int, default=48, help="per turn (%(default)s)")
    parser.add_argument(
        "--seconds", type=float, default=40.0, help="no turn starts later in a phase"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="of: %(default)s")
    parser.add_argument(
        "--short",
        action="store_true",
        help="what `make test` runs: one replica per service, 4 sessions of 2 turns, an "
        "orchestrator killed",
    )
    parser.add_argument("--checkpoint", type=Path, help="default: a tiny random one")
    args = parser.parse_args(argv)
    if args.short:
        args.sessions, args.turns, args.new_tokens, args.faults = 4, 2, 64, "orchestrator"
    args.faults = [FAULTS[name] for name in args.faults.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="chaos-") as scratch:
        checkpoint = args.checkpoint or tiny_checkpoint(Path(scratch))
        replicas = 1 if args.short else 2
        stack = ChaosStack(
            checkpoint, Path(scratch), trunk_replicas=replicas, shard_replicas=replicas
        )
        proxy = None
        try:
            stack.start()
            proxy = FaultProxy(stack.address("orchestrator0"))
            reference = run_phase(stack, proxy, REFERENCE, args)
            phases = [run_phase(stack, proxy, fault, args) for fault in args.faults]
        finally:
            if proxy is not None:
                proxy.close()
            stack.stop()
    print(table([row(phase, reference) for phase in [reference, *phases]]))
    return 0 if all(survived(phase, reference) for phase in phases) else 1


def tiny_checkpoint(root: Path) -> Path:
    """The tests' 4-head checkpoint (random weights): fast on 2 cores."""
    from tests.models import build_jury_checkpoint

    return build_jury_checkpoint(root / "model", trunk_layers=2)


if __name__ == "__main__":
    sys.exit(main())
