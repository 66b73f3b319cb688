"""The gRPC stack on loopback against the in-process engine, same requests, one run.

    python bench/bench_grpc.py --checkpoint var/models/smollm2-hydra

Starts a trunk service, two jury shards and the orchestrator as separate processes (the
`hydra-jury up` launcher, on free ports). For speculative PoE (γ=4) and non-speculative
PoE (`verifier_only`, one trunk→jury round trip per token) it measures:
- tokens/s end to end through the orchestrator (`Generate`), and in-process, and the ratio;
- bytes on the wire per round (orchestrator ↔ services), and the time of a round split
  into draft (trunk service), score (jury shards, concurrent), network and serialisation
  (client time of those calls minus the services' own time), and accept (acceptance,
  sampling, metrics in the loop) — from the same loop run with the gRPC backend in this
  process, instrumented.
"""

from __future__ import annotations

import argparse
import time

import grpc
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.grpc_backend import GrpcBackend
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.workers.sessions import SessionLimits

PROMPT = "Write a short story about a robot who learns to paint."
MODES = [
    ("speculative PoE γ=4", {"rule": "exact", "gamma": 4, "drafter": "head"}),
    ("non-speculative PoE (verifier_only)", {"rule": "verifier_only"}),
]


def request_options(options: dict, new_tokens: int) -> dict:
    return {
        "max_new_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": 0,
        **options,
    }


def in_process(engine: Engine, options: dict) -> tuple[float, list[int]]:
    request = GenerationRequest(messages=[{"role": "user", "content": PROMPT}], **options)
    began = time.perf_counter()
    output = engine.generate(request)
    return time.perf_counter() - began, output.token_ids


def through_orchestrator(stub, options: dict) -> tuple[float, list[int]]:
    request = generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=PROMPT)]
        ),
        options=generation_pb2.DecodingOptions(**options),
    )
    began = time.perf_counter()
    response = stub.Generate(request, timeout=600)
    return time.perf_counter() - began, list(response.token_ids)


def split(engine: Engine, backend: GrpcBackend, options: dict) -> dict:
    """Per-round means from the loop run here over the gRPC backend."""
    backend.stats.__init__()
    request = GenerationRequest(messages=[{"role": "user", "content": PROMPT}], **options)
    rounds = list(engine.stream(request))
    count = len(rounds)
    stats = backend.stats
    draft = sum(r.timings["draft_s"] for r in rounds) / count
    score = sum(r.timings["score_s"] for r in rounds) / count
    accept = sum(r.timings["accept_s"] for r in rounds) / count
    server_draft = stats.server_ns["draft"] / 1e9 / count
    server_score = stats.server_ns["score"] / 1e9 / count
    return {
        "bytes": (stats.bytes_sent + stats.bytes_received) / count,
        "draft": server_draft,
        "score": server_score,
        "network": draft + score - server_draft - server_score,
        "accept": accept,
        "round": draft + score + accept,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # The shards compute concurrently: on one host each gets its share of the cores.
    shard_threads = max(1, torch.get_num_threads() // 2)
    stack = LocalStack(args.checkpoint, shards=2, port=0, shard_threads=shard_threads)
    try:
        address = stack.start()
        trunk, *shards = (c.address for c in stack.children[:-1])
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
        model = HydraModel.load(args.checkpoint)
        tokenizer = model.load_tokenizer()
        local = Engine(LocalBackend(model, limits=SessionLimits(1, 1024)), tokenizer)
        backend = GrpcBackend.static(trunk, shards)
        remote = Engine(backend, tokenizer)
        print(
            f"gRPC stack (trunk, 2 jury shards, orchestrator: separate processes on "
            f"loopback) vs in-process; {args.checkpoint}; {args.new_tokens} new tokens, "
            f"temperature 0.8, seed 0; best of {args.repeats}; "
            f"{torch.get_num_threads()} threads per process"
        )
        print(
            "| mode | in-process tok/s | gRPC tok/s | ratio | bytes/round | draft ms | "
            "score ms | network+serialisation ms | accept ms | round ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, mode in MODES:
            options = request_options(mode, args.new_tokens)
            warm = request_options(mode, 8)
            in_process(local, warm)
            through_orchestrator(stub, warm)
            # Best of several, alternating, so both see the same machine state.
            local_s = grpc_s = float("inf")
            for _ in range(args.repeats):
                seconds, local_tokens = in_process(local, options)
                local_s = min(local_s, seconds)
                seconds, grpc_tokens = through_orchestrator(stub, options)
                grpc_s = min(grpc_s, seconds)
            assert grpc_tokens == local_tokens, "the gRPC stack must give the same tokens"
            parts = split(remote, backend, options)
            local_rate = len(local_tokens) / local_s
            grpc_rate = len(grpc_tokens) / grpc_s
            print(
                f"| {name} | {local_rate:.1f} | {grpc_rate:.1f} | "
                f"{grpc_rate / local_rate:.2f} | {parts['bytes']:,.0f} | "
                f"{parts['draft'] * 1e3:.1f} | {parts['score'] * 1e3:.1f} | "
                f"{parts['network'] * 1e3:.1f} | {parts['accept'] * 1e3:.1f} | "
                f"{parts['round'] * 1e3:.1f} |",
                flush=True,
            )
        backend.close()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
