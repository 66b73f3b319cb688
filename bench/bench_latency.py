"""The split stack as if its services ran on other machines: one session's tokens/s with
every orchestrator-to-service call delayed by 0, 0.5, 2 and 5 ms
(`--inject-hop-delay-ms`, half each way), non-speculative and speculative, beside what a
cost model fitted at 0 ms predicts.

    python bench/bench_latency.py --checkpoint var/models/smollm2-hydra

The cost model. A round makes two calls (a Draft to the trunk, then the Score to every
shard at once), each paying one hop delay d. A non-speculative round commits one token;
a speculative round commits `a` tokens on average (accepted drafts plus the
replacement or bonus token, measured). So the time per token is

    non-speculative:  t_n(d) = t_n(0) + 2d
    speculative:      t_s(d) = t_s(0) + 2d / a

with t_n(0) and t_s(0) measured without delay. Speculation pays once t_s(d) < t_n(d), so
the crossover delay is d* = (t_s(0) - t_n(0)) / (2 (1 - 1/a)) when speculation loses at
0 ms (it wins at every delay otherwise). Each row prints the measured tokens/s and the
model's prediction; the crossover is printed as predicted and as measured (linear
interpolation between the delays where the measured order flips).

Greedy (T = 0, the heads' own distributions decide), `--new-tokens` tokens of one
chat prompt, median of `--runs` requests per setting, the stack restarted for each delay.
Pipelined rounds (drafting round r + 1 while round r is scored) are not built yet.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
from bench_round import cpu_model  # this folder is on the path of `python bench/...`

from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

PROMPT = "Write a short story about a robot who learns to paint."
MODES = {
    "non-speculative PoE": {"rule": "verifier_only"},
    "speculative PoE, head γ=4": {"drafter": "head", "gamma": 4},
}


def measure(address: str, options: dict, new_tokens: int, runs: int) -> tuple[float, float]:
    """Median seconds per token over `runs` requests (after a warm-up), and the mean
    tokens committed per round."""
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = request_to_pb(
        GenerationRequest(
            messages=[{"role": "user", "content": PROMPT}],
            max_new_tokens=new_tokens,
            ignore_eos=True,
            temperature=0.0,
            **options,
        )
    )
    stub.Generate(request, timeout=600)
    per_token, per_round = [], []
    for _ in range(runs):
        began = time.perf_counter()
        response = stub.Generate(request, timeout=600)
        per_token.append((time.perf_counter() - began) / len(response.token_ids))
        per_round.append(len(response.token_ids) / response.stats.rounds)
    channel.close()
    return statistics.median(per_token), statistics.mean(per_round)


def crossover(delays: list[float], gaps: list[float]) -> float | None:
    """The delay where `gaps` (speculative minus non-speculative seconds per token)
    crosses zero, by linear interpolation; None if it never does."""
    for i in range(len(delays) - 1):
        (d0, g0), (d1, g1) = (delays[i], gaps[i]), (delays[i + 1], gaps[i + 1])
        if g0 > 0 >= g1:
            return d0 + (d1 - d0) * g0 / (g0 - g1)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--delays-ms", default="0,0.5,2,5", help="comma-separated")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    delays = [float(delay) / 1000 for delay in args.delays_ms.split(",")]
    if delays[0] != 0:
        parser.error("--delays-ms must start at 0 (the cost model is fitted there)")
    measured: dict[str, list[float]] = {name: [] for name in MODES}
    accepted: dict[str, float] = {}
    for delay in delays:
        stack = LocalStack(
            args.checkpoint,
            shards=2,
            port=0,
            orchestrator_args=["--inject-hop-delay-ms", f"{delay * 1000:g}"],
        )
        try:
            address = stack.start()
            for name, options in MODES.items():
                seconds, per_round = measure(address, options, args.new_tokens, args.runs)
                measured[name].append(seconds)
                accepted.setdefault(name, per_round)  # at 0 ms: the model's `a`
        finally:
            stack.stop()
    plain, speculative = MODES
    a = accepted[speculative]
    predicted = {
        plain: [measured[plain][0] + 2 * d for d in delays],
        speculative: [measured[speculative][0] + 2 * d / a for d in delays],
    }
    print(
        f"{cpu_model()}, {args.checkpoint}, split stack (trunk, 2 shards, orchestrator) on "
        f"loopback, greedy, {args.new_tokens} new tokens, median of {args.runs}; speculative "
        f"rounds commit {a:.2f} tokens on average"
    )
    print("| delay per hop (ms) | mode | tokens/s | predicted | error |")
    print("|---|---|---|---|---|")
    for index, delay in enumerate(delays):
        for name in MODES:
            rate, model = 1 / measured[name][index], 1 / predicted[name][index]
            print(
                f"| {delay * 1000:g} | {name} | {rate:.1f} | {model:.1f} | "
                f"{100 * (model - rate) / rate:+.0f}% |"
            )
    gaps = [s - n for s, n in zip(measured[speculative], measured[plain], strict=True)]
    found = crossover(delays, gaps)
    gap = measured[speculative][0] - measured[plain][0]
    model = gap / (2 * (1 - 1 / a)) if gap > 0 and a > 1 else None
    print(
        "crossover (speculation starts to pay): predicted "
        + (f"{model * 1000:.2f} ms" if model is not None else "at every delay")
        + ", measured "
        + (f"{found * 1000:.2f} ms" if found is not None else "none within the delays")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
