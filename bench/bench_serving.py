"""Concurrent sessions through the split stack: aggregate throughput and latency as the
number of sessions grows, for non-speculative PoE and speculative PoE (head drafts).

    python bench/bench_serving.py --checkpoint var/models/smollm2-hydra

Closed loop: each of N sessions sends its next request as soon as the previous one has
finished (chat prompts, greedy, the same new tokens each). Per setting: aggregate
tokens/s (every generated token over the wall time), and p50/p95 of the time to first
token (the first streamed round) and of the time per output token after it. The
services batch concurrent calls of different sessions into one forward (continuous
batching): the jury's Score and Prefill calls, the trunk's Prefill calls and plain
steps; head-drafted rounds run one session at a time on the trunk. The same table is
measured again with every forward limited to one call (`--max-batch-tokens 1`): the
services as they were before batching, side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import grpc
from bench_drafters import OPEN  # this folder is on the path of `python bench/...`

from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

PROMPTS = OPEN  # free chat, as in the drafters' benchmark
MODES = {
    "non-speculative PoE": {"rule": "verifier_only"},
    "speculative PoE, head γ=4": {"drafter": "head", "gamma": 4},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def session_loop(stub, index: int, requests: int, new_tokens: int, options: dict, out: list):
    for turn in range(requests):
        prompt = PROMPTS[(index + turn) % len(PROMPTS)]
        request = GenerationRequest(
            messages=[{"role": "user", "content": prompt}],
            max_new_tokens=new_tokens,
            ignore_eos=True,
            temperature=0.0,
            seed=index,
            **options,
        )
        began = time.perf_counter()
        first = None
        tokens = 0
        for message in stub.GenerateStream(request_to_pb(request), timeout=600):
            if message.tokens and first is None:
                first = time.perf_counter()
            tokens += len(message.tokens)
        ended = time.perf_counter()
        per_token = (ended - first) / max(1, tokens - 1)
        out.append((tokens, first - began, per_token))


def measure(address: str, sessions: int, requests: int, new_tokens: int, options: dict):
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    results: list[tuple[int, float, float]] = []
    threads = [
        threading.Thread(
            target=session_loop, args=(stub, i, requests, new_tokens, options, results)
        )
        for i in range(sessions)
    ]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    channel.close()
    tokens = sum(result[0] for result in results)
    ttft = [result[1] for result in results]
    tpot = [result[2] for result in results]
    return tokens / wall, ttft, tpot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--sessions", default="1,2,4,8,16", help="comma-separated counts")
    parser.add_argument("--requests", type=int, default=2, help="requests per session")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    counts = [int(count) for count in args.sessions.split(",")]
    print(
        f"{os.cpu_count()} cores, {args.checkpoint} ({args.dtype}), split stack (trunk, 2 "
        f"shards, orchestrator), {args.new_tokens} new tokens, greedy, "
        f"{args.requests} requests per session (closed loop)"
    )
    print(
        "| services | mode | sessions | tokens/s | × one session | TTFT p50 / p95 (ms) | "
        "TPOT p50 / p95 (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for services, limit in (("batched", []), ("one call per forward", ["--max-batch-tokens", "1"])):
        stack = LocalStack(
            args.checkpoint,
            shards=2,
            port=0,
            extra_service_args=["--dtype", args.dtype, *limit],
        )
        try:
            address = stack.start()
            measure(address, 1, 1, 8, MODES["non-speculative PoE"])  # warm-up
            for name, options in MODES.items():
                single = None
                for count in counts:
                    rate, ttft, tpot = measure(
                        address, count, args.requests, args.new_tokens, options
                    )
                    single = single or rate
                    print(
                        f"| {services} | {name} | {count} | {rate:.1f} | {rate / single:.2f} | "
                        f"{1000 * statistics.median(ttft):.0f} / "
                        f"{1000 * percentile(ttft, 0.95):.0f} | "
                        f"{1000 * statistics.median(tpot):.0f} / "
                        f"{1000 * percentile(tpot, 0.95):.0f} |",
                        flush=True,
                    )
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
