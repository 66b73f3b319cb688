"""The split stack as if its services ran on other machines: one session's tokens/s with
every orchestrator-to-service call delayed by 0, 0.5, 2 and 5 ms
(`--inject-hop-delay-ms`, half each way), non-speculative, speculative and pipelined
speculative (`--pipeline-rounds`), beside what a cost model fitted at 0 ms predicts.

    python bench/bench_latency.py --checkpoint var/models/smollm2-hydra

The cost model. A round makes two calls (a Draft to the trunk, then the Score to every
shard at once), each paying one hop delay d. A non-speculative round commits one token;
a speculative round commits `a` tokens on average (accepted drafts plus the
replacement or bonus token, measured). So the time per token is

    non-speculative:  t_n(d) = t_n(0) + 2d
    speculative:      t_s(d) = t_s(0) + 2d / a
    pipelined:        t_p(d) = t_p(0) + (2 - f) d / a

with t_n(0), t_s(0) and t_p(0) measured without delay. A pipelined round whose draft was
sent ahead (a fraction f of the rounds, measured) waited for it only while the jury
scored the round before: that draft's hop overlaps the score's, and the round pays one
delay instead of two. (Its compute does not overlap here: the trunk and the jury share
the same cores.) Speculation pays once t_s(d) < t_n(d), so the crossover delay is
d* = (t_s(0) - t_n(0)) / (2 (1 - 1/a)) when speculation loses at 0 ms (it wins at every
delay otherwise). Each row prints the measured tokens/s and the model's prediction; the
crossover is printed as predicted and as measured (linear interpolation between the
delays where the measured order flips).

Two placements of the processes on the host:
- shared: every process may run on every core (the services' default threads);
- apart: the trunk alone on CPU 0, the shards and the orchestrator on CPU 1, one compute
  thread each: the trunk and the jury as if on machines of their own, so that a
  pipelined round's draft really computes while the jury scores. (Shared, they take
  turns on the same cores and pipelining can only overlap the hops.)

Greedy (T = 0, the heads' own distributions decide), `--new-tokens` tokens of one
chat prompt, median of `--runs` requests per setting, the stacks restarted for each
delay (one without pipelining, then one with), speculative rounds at each γ of
`--gammas`.
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
PLAIN = "non-speculative PoE"
# Each placement's CPUs per process (LocalStack.cpus) and compute threads per service.
PLACEMENTS = {
    "shared": ({}, None),
    "apart": ({"trunk": "0", "jury0": "1", "jury1": "1", "orchestrator": "1"}, 1),
}


def mode_names(gamma: int) -> tuple[str, str]:
    return f"speculative PoE, head γ={gamma}", f"pipelined speculative PoE, head γ={gamma}"


def measure(address: str, options: dict, new_tokens: int, runs: int) -> tuple[float, float, float]:
    """Median seconds per token over `runs` requests (after a warm-up), the mean tokens
    committed per round, and the fraction of rounds whose draft was sent ahead."""
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
    per_token, per_round, ahead = [], [], []
    for _ in range(runs):
        began = time.perf_counter()
        response = stub.Generate(request, timeout=600)
        per_token.append((time.perf_counter() - began) / len(response.token_ids))
        per_round.append(len(response.token_ids) / response.stats.rounds)
        ahead.append(response.stats.drafts_ahead_used / response.stats.rounds)
    channel.close()
    return statistics.median(per_token), statistics.mean(per_round), statistics.mean(ahead)


def crossover(delays: list[float], gaps: list[float]) -> float | None:
    """The delay where `gaps` (speculative minus non-speculative seconds per token)
    crosses zero, by linear interpolation; None if it never does."""
    for i in range(len(delays) - 1):
        (d0, g0), (d1, g1) = (delays[i], gaps[i]), (delays[i + 1], gaps[i + 1])
        if g0 > 0 >= g1:
            return d0 + (d1 - d0) * g0 / (g0 - g1)
    return None


def run_placement(placement: str, args, delays: list[float], gammas: list[int]) -> None:
    """Measures every mode at every delay with the processes placed as `placement` says,
    and prints its tables."""
    cpus, threads = PLACEMENTS[placement]
    stacks = {  # pipelining or not -> the modes measured on that orchestrator
        False: {PLAIN: {"rule": "verifier_only"}},
        True: {},
    }
    for gamma in gammas:
        speculative, pipelined = mode_names(gamma)
        stacks[False][speculative] = stacks[True][pipelined] = {"drafter": "head", "gamma": gamma}
    measured: dict[str, list[float]] = {}
    per_round: dict[str, float] = {}  # at 0 ms: the model's `a`
    ahead: dict[str, float] = {}  # at 0 ms: the model's `f`
    for delay in delays:
        for pipelining, modes in stacks.items():
            flags = ["--inject-hop-delay-ms", f"{delay * 1000:g}"]
            stack = LocalStack(
                args.checkpoint,
                shards=2,
                port=0,
                orchestrator_args=flags + (["--pipeline-rounds"] if pipelining else []),
                extra_service_args=["--threads", str(threads)] if threads else [],
                cpus=cpus,
            )
            try:
                address = stack.start()
                for name, options in modes.items():
                    seconds, tokens, used = measure(address, options, args.new_tokens, args.runs)
                    measured.setdefault(name, []).append(seconds)
                    per_round.setdefault(name, tokens)
                    ahead.setdefault(name, used)
            finally:
                stack.stop()
    predicted = {
        name: [
            times[0] + (2 - ahead[name]) * d / (per_round[name] if name != PLAIN else 1)
            for d in delays
        ]
        for name, times in measured.items()
    }
    print(
        f"\n{placement}: {cpu_model()}, {args.checkpoint}, split stack (trunk, 2 shards, "
        f"orchestrator) on loopback, greedy, {args.new_tokens} new tokens, median of "
        f"{args.runs}; tokens a round (a) and rounds using a draft sent ahead (f) at 0 ms: "
        + ", ".join(f"{name} a = {per_round[name]:.2f}, f = {ahead[name]:.2f}" for name in ahead)
    )
    print("| delay per hop (ms) | mode | tokens/s | predicted | error |")
    print("|---|---|---|---|---|")
    for index, delay in enumerate(delays):
        for name, times in measured.items():
            rate, model = 1 / times[index], 1 / predicted[name][index]
            print(
                f"| {delay * 1000:g} | {name} | {rate:.1f} | {model:.1f} | "
                f"{100 * (model - rate) / rate:+.0f}% |"
            )
    print("\n| delay per hop (ms) | γ | pipelined / speculative | predicted |")
    print("|---|---|---|---|")
    for index, delay in enumerate(delays):
        for gamma in gammas:
            speculative, pipelined = mode_names(gamma)
            rate = measured[speculative][index] / measured[pipelined][index]
            model = predicted[speculative][index] / predicted[pipelined][index]
            print(f"| {delay * 1000:g} | {gamma} | {rate:.2f} | {model:.2f} |")
    for gamma in gammas:
        speculative, _ = mode_names(gamma)
        a = per_round[speculative]
        gaps = [s - n for s, n in zip(measured[speculative], measured[PLAIN], strict=True)]
        found = crossover(delays, gaps)
        gap = gaps[0]
        model = gap / (2 * (1 - 1 / a)) if gap > 0 and a > 1 else None
        print(
            f"γ = {gamma}, crossover (speculation starts to pay): predicted "
            + (f"{model * 1000:.2f} ms" if model is not None else "at every delay")
            + ", measured "
            + (f"{found * 1000:.2f} ms" if found is not None else "none within the delays")
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--delays-ms", default="0,0.5,2,5", help="comma-separated")
    parser.add_argument("--gammas", default="2,4", help="comma-separated draft lengths")
    parser.add_argument(
        "--placements", default="shared,apart", help=f"comma-separated: {', '.join(PLACEMENTS)}"
    )
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    delays = [float(delay) / 1000 for delay in args.delays_ms.split(",")]
    if delays[0] != 0:
        parser.error("--delays-ms must start at 0 (the cost model is fitted there)")
    placements = args.placements.split(",")
    unknown = sorted(set(placements) - set(PLACEMENTS))
    if unknown:
        parser.error(f"unknown placements {unknown}; known: {', '.join(PLACEMENTS)}")
    for placement in placements:
        run_placement(placement, args, delays, [int(g) for g in args.gammas.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
