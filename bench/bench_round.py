"""Where a decoding round's time goes, and how close decoding comes to the memory roofline,
for juries of 1, 2, 3 and 4 heads: in-process and through `hydra-jury serve`.

    python bench/bench_round.py --checkpoint var/models/smollm2-hydra

Greedy non-speculative PoE (`verifier_only`: one trunk step and one jury call per token),
the same request each way, `--new-tokens` tokens, median of `--runs` runs:

- raw runtime: the trunk and the jury's heads as one stack in a bare greedy loop, no
  engine: what the forward passes alone cost;
- in-process: the engine over the in-process backend, with timers on each phase of a
  round (`round_profile`): the table of where a round's time goes;
- serve: the same request through gRPC to `hydra-jury serve` (a process started for the
  benchmark, idle while the in-process runs go). In-process and serve runs alternate, so
  that a machine whose speed drifts (a virtual machine's memory bandwidth can move by a
  third from one minute to the next) weighs on both alike.

The bytes roofline: a token must read the trunk's layers, its jury's head layers and the
output matrix once (the checkpoint's dtype), at most as fast as the machine copies memory
(a 256 MiB tensor copy, bytes read and written per second, best of 5). Each row's
fraction is its tokens/s over the roofline's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch
from bench_one_host import start_server  # this folder is on the path
from round_profile import PHASES, REST, PhaseProfiler

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.quantization import tensors_of
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc
from hydra_jury.workers.sessions import SessionLimits

PROMPT = "Write a short story about a robot who learns to paint."
COPY_BYTES = 256 * 2**20


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def copy_bandwidth() -> float:
    """Bytes read and written per second by a 256 MiB tensor copy (best of 5)."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(6):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return 2 * COPY_BYTES / best


def bytes_per_token(model: HydraModel, jury_size: int) -> int:
    """Weights one non-speculative token reads: trunk layers, the jury's head layers and
    the output matrix once (an embedding row is negligible)."""
    trunk = sum(t.nbytes for t in model.trunk.layers.tensors())
    heads = model.heads
    head = sum(t.nbytes for t in heads.layers.tensors()) // heads.size
    output = sum(t.nbytes for t in tensors_of(heads.lm_head))  # quantized: with its scales
    if heads.shares_lm_head:  # one matrix, read once for every juror's row
        return trunk + jury_size * head + output
    return trunk + jury_size * (head + output // heads.size)


def raw_rate(model: HydraModel, prompt: list[int], size: int, new_tokens: int) -> float:
    """Tokens/s of a bare greedy loop over the trunk and `size` heads (head 0's argmax)."""
    first, later = raw_steps(model, prompt, size, new_tokens)
    return new_tokens / (first + later * (new_tokens - 1))


def raw_steps(
    model: HydraModel, prompt: list[int], size: int, new_tokens: int
) -> tuple[float, float]:
    """`raw_rate`'s loop: the seconds of its first step (the prompt's) and of each step
    after it."""
    steps = bare_steps(model, prompt, size, new_tokens)
    began = time.perf_counter()
    next(steps)
    prompted = time.perf_counter()
    for _ in steps:
        pass
    return prompted - began, (time.perf_counter() - prompted) / max(1, new_tokens - 1)


def bare_steps(model: HydraModel, prompt: list[int], size: int, new_tokens: int) -> Iterator[None]:
    """The bare greedy loop over the trunk and `size` heads (head 0's argmax), one step
    per `next`: the prompt's first, then one position each."""
    stack = model.heads.select(0, size)  # the jury of the first `size` heads
    capacity = len(prompt) + new_tokens
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(size, capacity)
    tokens, start = torch.tensor(prompt), 0
    for _ in range(new_tokens):
        hidden = model.trunk.forward(tokens, trunk_cache, start)
        logits = stack.forward(hidden, head_cache, start)
        start += len(tokens)
        tokens = logits[0, -1:].argmax(-1)
        yield


def request(jury: list[str], new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": PROMPT}],
        max_new_tokens=new_tokens,
        ignore_eos=True,
        temperature=0.0,
        rule="verifier_only",
        jury=jury,
    )


def engine_rate(engine: Engine, jury: list[str], new_tokens: int) -> float:
    """Tokens/s of one request with no timer patched in (`in_process` has them)."""
    engine.generate(request(jury, 8))  # warm-up
    began = time.perf_counter()
    output = engine.generate(request(jury, new_tokens))
    return len(output.token_ids) / (time.perf_counter() - began)


def steady_ratio(
    model: HydraModel, prompt: list[int], engine: Engine, jury: list[str], new_tokens: int
) -> float:
    """The bare loop's mean step over the engine's mean round, both after their first
    (the prompt's), in one run where a bare step and an engine round take turns: each
    round is timed beside a step taken a few milliseconds before it, so a machine whose
    speed drifts from one second to the next weighs on both alike (runs of each taken
    turn about, a second apart, differ by more than the engine's own cost). What the
    engine's round costs the next step's weights in the caches (it touches more memory
    than a bare step) falls on both alike here: a whole request shows it. `prompt` is
    the chat prompt `request` gives the engine; the bare loop's jury is its first
    len(jury) heads."""
    steps = bare_steps(model, prompt, len(jury), new_tokens)
    rounds = iter(engine.start(request(jury, new_tokens)))
    next(steps), next(rounds)
    bare = through_engine = 0.0
    done = object()
    while True:
        began = time.perf_counter()
        if next(steps, done) is done:
            break
        stepped = time.perf_counter()
        if next(rounds, done) is done:  # a round of one token for each step of the bare loop
            raise RuntimeError("the engine's request ended before the bare loop's steps")
        bare += stepped - began
        through_engine += time.perf_counter() - stepped
    return bare / through_engine


def in_process(engine: Engine, jury: list[str], new_tokens: int) -> tuple[float, dict, list]:
    """Tokens/s of one request, each phase's seconds per token, and the tokens."""
    engine.generate(request(jury, 8))  # warm-up
    profiler = PhaseProfiler()
    with profiler.installed():
        began = time.perf_counter()
        output = engine.generate(request(jury, new_tokens))
        wall = time.perf_counter() - began
    emitted = len(output.token_ids)
    per_token = {phase: seconds / emitted for phase, seconds in profiler.shares(wall).items()}
    return emitted / wall, per_token, list(output.token_ids)


def through_serve(stub, jury: list[str], new_tokens: int) -> tuple[float, list[int]]:
    message = request_to_pb(request(jury, new_tokens))
    began = time.perf_counter()
    response = stub.Generate(message, timeout=600)
    return len(response.token_ids) / (time.perf_counter() - began), list(response.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model = HydraModel.load(args.checkpoint)
    tokenizer = model.load_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    juries = [model.head_names[:size] for size in range(1, len(model.head_names) + 1)]
    bandwidth = copy_bandwidth()
    print(
        f"{cpu_model()}, {torch.get_num_threads()} threads, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; {Path(args.checkpoint).name} ({model.dtype}), greedy "
        f"verifier_only, {args.new_tokens} new tokens, median of {args.runs} runs\n"
    )
    engine = Engine(LocalBackend(model, limits=SessionLimits(1, 1024)), tokenizer)
    server = start_server(args.checkpoint)
    try:
        if not server.address:
            raise RuntimeError(server.failure)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(server.address))
        rows = {len(jury): alternated(args, engine, stub, jury) for jury in juries}
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
    for jury in juries:
        rows[len(jury)]["raw"] = statistics.median(
            raw_rate(model, prompt, len(jury), args.new_tokens) for _ in range(args.runs)
        )
    report(model, bandwidth, rows)


def alternated(args: argparse.Namespace, engine: Engine, stub, jury: list[str]) -> dict:
    """`--runs` in-process runs and as many through `serve`, one after the other in turn:
    the in-process median run's rate, phases and tokens, and serve's median rate."""
    through_serve(stub, jury, 8)  # warm-up (in_process warms up on each call)
    local, served = [], []
    for _ in range(args.runs):
        local.append(in_process(engine, jury, args.new_tokens))
        served.append(through_serve(stub, jury, args.new_tokens))
    median = sorted(local, key=lambda run: run[0])[len(local) // 2]
    for _, tokens in served:
        if tokens != median[2]:
            raise AssertionError(f"serve gave other tokens than in-process ({jury})")
    serve = statistics.median(rate for rate, _ in served)
    return {"in-process": median[0], "phases": median[1], "tokens": median[2], "serve": serve}


def report(model: HydraModel, bandwidth: float, rows: dict) -> None:
    print("Tokens/s and the fraction of the bytes roofline:\n")
    header = ["jury", "MB/token", "roofline tok/s", "raw runtime", "in-process", "serve"]
    print("| " + " | ".join([*header, "serve/in-process"]) + " |")
    print("| --- " * (len(header) + 1) + "|")
    for size, row in rows.items():
        need = bytes_per_token(model, size)
        roof = bandwidth / need
        cells = [
            f"{row[key]:.1f} ({row[key] / roof:.0%})" for key in ("raw", "in-process", "serve")
        ]
        print(
            f"| {size} head{'s' if size > 1 else ''} | {need / 1e6:.0f} | {roof:.1f} | "
            f"{' | '.join(cells)} | {row['serve'] / row['in-process']:.2f} |"
        )
    print("\nIn-process, where a round's time goes (ms per token, share of the round):\n")
    phases = [*PHASES, REST]
    print("| jury | " + " | ".join(phases) + " | outside forward |")
    print("| --- " * (len(phases) + 2) + "|")
    for size, row in rows.items():
        spent = row["phases"]
        total = sum(spent.values())
        outside = 1 - (spent["trunk forward"] + spent["heads forward"]) / total
        cells = [f"{spent[p] * 1e3:.2f} ({spent[p] / total:.0%})" for p in phases]
        print(f"| {size} head{'s' if size > 1 else ''} | {' | '.join(cells)} | {outside:.1%} |")


if __name__ == "__main__":
    main()
