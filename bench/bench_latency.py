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
delay otherwise). Each row prints the measured tokens/s and the model's prediction.

The crossover, measured. The gap it divides is small (a few percent of a token's time)
and of the size of the machine's drift between runs, so the requests are made in turns
(one of each mode a turn, on one stack) and compared within a turn: each turn gives a
pair's gap, speculative minus non-speculative seconds per token. The prediction takes
the median gap at 0 ms; the measured crossover is where the least-squares line through
every pair at every delay crosses zero, with a 90% bootstrap interval (the pairs
resampled); beside it, the old estimate, interpolated between the two delays' median
gaps where they change sign.

Two placements of the processes on the host:
- shared: every process may run on every core (the services' default threads);
- apart: the trunk alone on CPU 0, the shards and the orchestrator on CPU 1, one compute
  thread each: the trunk and the jury as if on machines of their own, so that a
  pipelined round's draft really computes while the jury scores. (Shared, they take
  turns on the same cores and pipelining can only overlap the hops.)

Greedy (T = 0, the heads' own distributions decide), `--new-tokens` tokens of one
chat prompt, speculative rounds at each γ of `--gammas`. One set of services per
placement (a trunk, two shards) and an orchestrator over them for each delay, with
pipelining and without: `--runs` turns of one request of every mode at every delay
(medians in the tables), so that every setting meets the same processes and the same
drift.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field

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


Setting = tuple[float, str]  # (hop delay in seconds, mode)


@dataclass
class Sample:
    """One mode's requests on one stack: seconds per token of each (in turn order), the
    tokens committed per round and the fraction of rounds whose draft was sent ahead."""

    per_token: list[float] = field(default_factory=list)
    per_round: list[float] = field(default_factory=list)
    ahead: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(self.per_token)


def measure(
    targets: dict[Setting, tuple[str, dict]], new_tokens: int, runs: int
) -> dict[Setting, Sample]:
    """`runs` turns (after a warm-up request of each setting), each one request of every
    setting (its orchestrator's address, its request options), the first of a turn
    rotating: so that the machine's drift weighs on every setting alike and a turn's
    requests can be compared pairwise."""
    channels = {address: grpc.insecure_channel(address) for address, _ in targets.values()}
    stubs = {address: generation_pb2_grpc.GenerationStub(c) for address, c in channels.items()}
    requests = {
        setting: (
            stubs[address],
            request_to_pb(
                GenerationRequest(
                    messages=[{"role": "user", "content": PROMPT}],
                    max_new_tokens=new_tokens,
                    ignore_eos=True,
                    temperature=0.0,
                    **options,
                )
            ),
        )
        for setting, (address, options) in targets.items()
    }
    for stub, request in requests.values():
        stub.Generate(request, timeout=600)
    samples = {setting: Sample() for setting in requests}
    order = list(requests)
    for turn in range(runs):
        first = turn % len(order)
        for setting in order[first:] + order[:first]:
            stub, request = requests[setting]
            began = time.perf_counter()
            response = stub.Generate(request, timeout=600)
            sample = samples[setting]
            sample.per_token.append((time.perf_counter() - began) / len(response.token_ids))
            sample.per_round.append(len(response.token_ids) / response.stats.rounds)
            sample.ahead.append(response.stats.drafts_ahead_used / response.stats.rounds)
    for channel in channels.values():
        channel.close()
    return samples


def crossover(delays: list[float], gaps: list[float]) -> float | None:
    """The delay where `gaps` (speculative minus non-speculative seconds per token)
    crosses zero, by linear interpolation; None if it never does."""
    for i in range(len(delays) - 1):
        (d0, g0), (d1, g1) = (delays[i], gaps[i]), (delays[i + 1], gaps[i + 1])
        if g0 > 0 >= g1:
            return d0 + (d1 - d0) * g0 / (g0 - g1)
    return None


def fitted_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points` (delay, gap)."""
    mean_d = statistics.fmean(d for d, _ in points)
    mean_g = statistics.fmean(g for _, g in points)
    spread = sum((d - mean_d) ** 2 for d, _ in points)
    slope = sum((d - mean_d) * (g - mean_g) for d, g in points) / spread
    return mean_g - slope * mean_d, slope


def fitted_crossover(pairs: dict[float, list[float]]) -> float | None:
    """Where the least-squares line through every pair's gap (delay -> gaps of the
    turns at that delay) crosses zero; None where it does not at a positive delay."""
    intercept, slope = fitted_line([(d, g) for d, gaps in pairs.items() for g in gaps])
    return -intercept / slope if intercept > 0 > slope else None


def bootstrap_interval(pairs: dict[float, list[float]], draws: int = 2000) -> tuple[float, float]:
    """A 90% interval of `fitted_crossover`, resampling each delay's pairs (fixed seed);
    resamples without a crossover count as infinitely far."""
    rng = random.Random(0)
    found = sorted(
        fitted_crossover({d: rng.choices(gaps, k=len(gaps)) for d, gaps in pairs.items()})
        or math.inf
        for _ in range(draws)
    )
    return found[draws // 20], found[draws - 1 - draws // 20]


def hop_delay(delay: float) -> list[str]:
    """An orchestrator's flags delaying every call to a service by `delay` seconds."""
    return ["--inject-hop-delay-ms", f"{delay * 1000:g}"]


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
    stack = LocalStack(
        args.checkpoint,
        shards=2,
        port=0,
        orchestrator_args=hop_delay(delays[0]),
        extra_service_args=["--threads", str(threads)] if threads else [],
        cpus=cpus,
    )
    try:
        targets = {}
        for delay in delays:
            for pipelining, modes in stacks.items():
                flags = hop_delay(delay) + (["--pipeline-rounds"] if pipelining else [])
                # The stack's own orchestrator is the first setting's (0 ms, unpipelined).
                address = stack.add_orchestrator(flags) if targets else stack.start()
                for name, options in modes.items():
                    targets[delay, name] = (address, options)
        samples = measure(targets, args.new_tokens, args.runs)
    finally:
        stack.stop()
    measured: dict[str, list[Sample]] = {}  # mode -> its sample at each delay
    for (_, name), sample in samples.items():
        measured.setdefault(name, []).append(sample)
    # At 0 ms: the model's `a` (tokens a round) and `f` (rounds using a draft sent ahead).
    per_round = {name: statistics.fmean(samples[0].per_round) for name, samples in measured.items()}
    ahead = {name: statistics.fmean(samples[0].ahead) for name, samples in measured.items()}
    predicted = {
        name: [
            samples[0].seconds + (2 - ahead[name]) * d / (per_round[name] if name != PLAIN else 1)
            for d in delays
        ]
        for name, samples in measured.items()
    }
    print(
        f"\n{placement}: {cpu_model()}, {args.checkpoint}, split stack (trunk, 2 shards, "
        f"orchestrator) on loopback, greedy, {args.new_tokens} new tokens, median of "
        f"{args.runs} turns; tokens a round (a) and rounds using a draft sent ahead (f) at "
        "0 ms: "
        + ", ".join(f"{name} a = {per_round[name]:.2f}, f = {ahead[name]:.2f}" for name in ahead)
    )
    print("| delay per hop (ms) | mode | tokens/s | predicted | error |")
    print("|---|---|---|---|---|")
    for index, delay in enumerate(delays):
        for name, samples in measured.items():
            rate, model = 1 / samples[index].seconds, 1 / predicted[name][index]
            print(
                f"| {delay * 1000:g} | {name} | {rate:.1f} | {model:.1f} | "
                f"{100 * (model - rate) / rate:+.0f}% |"
            )
    print("\n| delay per hop (ms) | γ | pipelined / speculative | predicted |")
    print("|---|---|---|---|")
    for index, delay in enumerate(delays):
        for gamma in gammas:
            speculative, pipelined = mode_names(gamma)
            rate = measured[speculative][index].seconds / measured[pipelined][index].seconds
            model = predicted[speculative][index] / predicted[pipelined][index]
            print(f"| {delay * 1000:g} | {gamma} | {rate:.2f} | {model:.2f} |")
    for gamma in gammas:
        print_crossover(gamma, delays, measured, per_round[mode_names(gamma)[0]])


def print_crossover(gamma: int, delays: list[float], measured: dict, a: float) -> None:
    """Speculation against non-speculative decoding at γ, from the pairs of requests
    made in the same turn on one stack: their gap (speculative minus non-speculative
    seconds per token) at 0 ms and the model's crossover from it, against the crossover
    of the line fitted through every pair at every delay. (Greedy, each request's rounds
    are the same at every delay, so the gap falls linearly with the delay by
    construction; the fit spends every pair on the two numbers that place it, where
    interpolating between two delays' medians rests on the noise of four requests.)"""
    speculative = mode_names(gamma)[0]
    pairs = {
        delay: [s - n for s, n in zip(spec.per_token, plain.per_token, strict=True)]
        for delay, spec, plain in zip(delays, measured[speculative], measured[PLAIN], strict=True)
    }
    gap = statistics.median(pairs[0.0])
    model = gap / (2 * (1 - 1 / a)) if gap > 0 and a > 1 else None
    intercept, slope = fitted_line([(d, g) for d, gaps in pairs.items() for g in gaps])
    found = fitted_crossover(pairs)
    low, high = bootstrap_interval(pairs)
    between = crossover(delays, [statistics.median(gaps) for gaps in pairs.values()])

    def ms(seconds: float | None) -> str:
        return "none" if seconds is None or math.isinf(seconds) else f"{seconds * 1000:.2f} ms"

    print(
        f"γ = {gamma}: gap at 0 ms {gap * 1000:+.2f} ms a token (median of "
        f"{len(pairs[0.0])} pairs; the fitted line's {intercept * 1000:+.2f}); slope "
        f"{slope:+.3f} ms a token per ms of delay (model {-2 * (1 - 1 / a):+.3f}); crossover "
        f"(speculation starts to pay): predicted "
        + (ms(model) if model is not None else "at every delay (it wins at 0 ms)")
        + f", measured {ms(found)} (90%: {ms(low)} to {ms(high)}), between the medians "
        + ms(between)
        + (
            f"; prediction {100 * (model - found) / found:+.0f}%"
            if model is not None and found is not None
            else ""
        )
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
    parser.add_argument(
        "--runs", type=int, default=8, help="turns: one request of every mode at every delay a turn"
    )
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
