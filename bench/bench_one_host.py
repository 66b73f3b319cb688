"""One host, four ways to serve the same requests, measured alternately.

    python bench/bench_one_host.py --checkpoint var/models/smollm2-hydra [--runs 5]

- in-process, OpenMP spinning (`OMP_WAIT_POLICY=ACTIVE`) and passive (`PASSIVE`): the
  engine over the in-process backend, in a process started for each measurement (the
  wait policy is read when OpenMP starts, and an idle process with spinning threads
  would steal a core from the other measurements);
- the single-process server (`hydra-jury serve`) through gRPC;
- the split stack (`hydra-jury up`: trunk, two jury shards, orchestrator) through gRPC;
- the split stack with one jury shard (`up --shards 1`), the cheaper split on one host.

For speculative PoE (γ=4) and non-speculative PoE, every run sends the same request to
each in turn (so all see the same machine state) and checks they return the same
tokens. Reports the median tokens/s over the runs with the spread (min–max), and the two
goals: the single-process server ≥ 0.95× the best in-process run, the split stack ≥
0.85× the single-process server.

Then where a round's time goes, in-process against the split stack: the loop run once
more in a fresh in-process worker (OpenMP spinning) and once over the gRPC backend,
against the split stack's own trunk and shards, in a process started like the stack's
orchestrator (waiting passively). Per round: the draft and
score calls as the services timed them, network and serialisation (the client's time
of those calls less the services'), accept (acceptance, sampling, metrics in the loop),
and the bytes on the wire.

Every server holds at most 4 sessions (`--max-sessions 4`): each preallocates its cache
slots, and three servers of the default 16 sessions of 4,096 positions need more than
the 24 GiB of the development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.launcher import LocalStack, start_child
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

PROMPT = "Write a short story about a robot who learns to paint."
SESSIONS = ["--max-sessions", "4"]  # cache slots per server (see above)
MODES = {
    "speculative PoE γ=4": {"rule": "exact", "gamma": 4, "drafter": "head"},
    "non-speculative PoE": {"rule": "verifier_only"},
}


def request(mode: str, new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": PROMPT}],
        max_new_tokens=new_tokens,
        ignore_eos=True,
        temperature=0.8,
        seed=0,
        **MODES[mode],
    )


def round_means(rounds: list) -> dict[str, float]:
    """Mean seconds per round of each part of the loop's round timings."""
    return {
        part: sum(r.timings[f"{part}_s"] for r in rounds) / len(rounds)
        for part in ("draft", "score", "accept")
    }


def worker(checkpoint: str, mode: str, new_tokens: int, breakdown: bool, services: str) -> None:
    """One measured generation after a warm-up, as JSON: in-process, or (`services`:
    "TRUNK,SHARD,...") over the gRPC backend against those services. `breakdown`: the
    per-round timings instead (and, over gRPC, the services' own time and the bytes)."""
    from hydra_jury.orchestrator.engine import Engine

    if services:
        from transformers import AutoTokenizer

        from hydra_jury.orchestrator.grpc_backend import GrpcBackend

        trunk, *shards = services.split(",")
        backend = GrpcBackend.static(trunk, shards)
        engine = Engine(backend, AutoTokenizer.from_pretrained(checkpoint))
    else:
        from hydra_jury.hydra_model import HydraModel
        from hydra_jury.orchestrator.local_backend import LocalBackend
        from hydra_jury.workers.sessions import SessionLimits

        model = HydraModel.load(checkpoint)
        backend = LocalBackend(model, limits=SessionLimits(1, 1024))
        engine = Engine(backend, model.load_tokenizer())
    engine.generate(request(mode, 8))
    if not breakdown:
        began = time.perf_counter()
        output = engine.generate(request(mode, new_tokens))
        seconds = time.perf_counter() - began
        print(json.dumps({"seconds": seconds, "tokens": output.token_ids}), flush=True)
        return
    if services:
        backend.stats.__init__()
    rounds = list(engine.stream(request(mode, new_tokens)))
    count = len(rounds)
    parts = round_means(rounds)
    if services:
        stats = backend.stats
        parts["network"] = parts["draft"] + parts["score"]
        for phase in ("draft", "score"):
            parts[phase] = stats.server_ns[phase] / 1e9 / count
            parts["network"] -= parts[phase]
        parts["bytes"] = (stats.bytes_sent + stats.bytes_received) / count
    print(json.dumps({"rounds": count, **parts}), flush=True)


def run_worker(checkpoint: str, env: dict[str, str], mode: str, new_tokens: int, *flags: str):
    """`worker` in a process of its own, started with `env`; its JSON answer."""
    command = [
        *(sys.executable, __file__, "--worker", "--checkpoint", checkpoint),
        *("--mode", mode, "--new-tokens", str(new_tokens), *flags),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


class InProcess:
    def __init__(self, checkpoint: str, wait_policy: str) -> None:
        self.name = f"in-process, OMP_WAIT_POLICY={wait_policy}"
        self.checkpoint = checkpoint
        self.env = {**os.environ, "OMP_WAIT_POLICY": wait_policy}

    def generate(self, mode: str, new_tokens: int) -> tuple[float, list[int]]:
        answer = run_worker(self.checkpoint, self.env, mode, new_tokens)
        return answer["seconds"], answer["tokens"]


def start_server(checkpoint: str, args: list[str] = SESSIONS):
    """`hydra-jury serve` on a free loopback port with `args`, as a child process
    (`start_child`)."""
    command = [sys.executable, "-m", "hydra_jury.cli", "serve", "--checkpoint", checkpoint]
    return start_child("server", [*command, "--listen", "127.0.0.1:0", *args], 300)


class ThroughGrpc:
    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def generate(self, mode: str, new_tokens: int) -> tuple[float, list[int]]:
        message = request_to_pb(request(mode, new_tokens))
        began = time.perf_counter()
        response = self.stub.Generate(message, timeout=600)
        return time.perf_counter() - began, list(response.token_ids)


@dataclass
class Results:
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, config: str, mode: str, rate: float) -> None:
        self.rates.setdefault((config, mode), []).append(rate)

    def median(self, config: str, mode: str) -> float:
        return statistics.median(self.rates[config, mode])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--services", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.checkpoint, args.mode, args.new_tokens, args.breakdown, args.services)
    checkpoint = str(Path(args.checkpoint))
    configs: list = [InProcess(checkpoint, "ACTIVE"), InProcess(checkpoint, "PASSIVE")]
    server = start_server(checkpoint)
    stacks = [
        LocalStack(checkpoint, shards=shards, port=0, extra_service_args=SESSIONS)
        for shards in (2, 1)
    ]
    try:
        if not server.address:
            raise RuntimeError(server.failure)
        configs.append(ThroughGrpc("single-process server (gRPC)", server.address))
        configs.append(ThroughGrpc("split stack (gRPC)", stacks[0].start()))
        configs.append(ThroughGrpc("split stack, 1 shard (gRPC)", stacks[1].start()))
        results = Results()
        for mode in MODES:
            for config in configs[2:]:
                config.generate(mode, 8)  # warm-up (the in-process runs warm up their own)
        for _ in range(args.runs):
            for mode in MODES:
                tokens = None
                for config in configs:
                    seconds, generated = config.generate(mode, args.new_tokens)
                    assert tokens is None or generated == tokens, f"{config.name}: other tokens"
                    tokens = generated
                    results.add(config.name, mode, len(generated) / seconds)
        report(results, configs, args)
        breakdown(configs[0], stacks[0], args)
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
        for stack in stacks:
            stack.stop()


def report(results: Results, configs: list, args: argparse.Namespace) -> None:
    cores = os.cpu_count()
    print(
        f"one host ({cores} cores), {args.checkpoint}, {args.new_tokens} new tokens, "
        f"temperature 0.8, seed 0; median of {args.runs} alternating runs (min–max)"
    )
    print("| mode | " + " | ".join(c.name for c in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for mode in MODES:
        cells = []
        for config in configs:
            rates = results.rates[config.name, mode]
            cells.append(f"{statistics.median(rates):.1f} ({min(rates):.1f}–{max(rates):.1f})")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    single = configs[2].name
    for mode in MODES:
        best = max(results.median(c.name, mode) for c in configs[:2])
        server_ratio = results.median(single, mode) / best
        splits = ", ".join(
            f"{c.name} / single-process server = "
            f"{results.median(c.name, mode) / results.median(single, mode):.2f}"
            for c in configs[3:]
        )
        print(
            f"{mode}: single-process server / best in-process = {server_ratio:.2f} "
            f"(goal 0.95); {splits} (goal 0.85)"
        )


def breakdown(in_process: InProcess, stack: LocalStack, args: argparse.Namespace) -> None:
    """Where a round's time goes: in-process (spinning) against the split stack's
    services, reached from a process started like the stack's orchestrator."""
    services = ",".join(child.address for child in stack.children[:-1])
    split_env = stack.environment("orchestrator")
    print(
        "\nper round, ms: draft and score as the services timed them; network and "
        "serialisation: the rest of those calls; accept: the loop's own work"
    )
    print(
        "| mode | run | rounds | draft | score | network+serialisation | accept | round | bytes |"
    )
    print("|---" * 9 + "|")
    for mode in MODES:
        for name, env, flags in (
            ("in-process", in_process.env, ()),
            ("split stack", split_env, ("--services", services)),
        ):
            parts = run_worker(args.checkpoint, env, mode, args.new_tokens, "--breakdown", *flags)
            network = parts.get("network")
            cells = [
                parts["draft"],
                parts["score"],
                network,
                parts["accept"],
                parts["draft"] + parts["score"] + parts["accept"] + (network or 0.0),
            ]
            shown = " | ".join("-" if c is None else f"{1e3 * c:.1f}" for c in cells)
            wire = f"{parts['bytes']:,.0f}" if "bytes" in parts else "-"
            print(f"| {mode} | {name} | {parts['rounds']} | {shown} | {wire} |", flush=True)


if __name__ == "__main__":
    main()
