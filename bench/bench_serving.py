"""Concurrent sessions through both servers (the split stack and `hydra-jury serve`):
aggregate throughput and latency as the number of sessions grows, for non-speculative
PoE, speculative PoE (head drafts) and the automatic drafter, in float32 and bfloat16,
with batching on and off; and how often a seeded request gives the same tokens alone
and inside a batch.

    python bench/bench_serving.py --checkpoint var/models/smollm2-hydra

Closed loop: each of N sessions sends its next request as soon as the previous one has
finished (chat prompts, the same new tokens each, sampled at T = 0.8 with a seed per
request), `--requests` each; or with `--duration S`, for S seconds, counting the tokens
streamed by then. The first measures until the slowest session's last request ends:
sessions that speculation sped up then sit idle while it finishes, and their batches
shrink; the second keeps every session busy, as a server under steady load is. Per
setting: aggregate tokens/s (every generated token over the wall time),
and p50/p95 of the time to first token (the first streamed round) and of the time per
output token after it. The services, and `serve`'s in-process workers, batch concurrent
calls of different sessions into one forward (continuous batching); with `--unbatched`
the same table is measured with every forward limited to one call (`--max-batch-tokens
1`): the servers as they were before batching, side by side in one run.

After the table, per session count, the automatic drafter's rounds by drafter (plain
steps, prompt lookup, head drafts), from the statistics of its finished requests.

With `--repeats N` every setting runs N times, the modes in turn at each session count
(every mode at one count before the next count, their order reversed every other
time), and each row is the median of its runs; after the table, per count, the
automatic drafter against the best fixed mode, taken run by run between settings that
ran side by side. (A machine whose speed drifts by a quarter within minutes otherwise
decides that comparison: run one mode after another, the 2-core Zen 3 machine put the
automatic drafter at 0.88x non-speculative PoE at 8 sessions of `serve`, where it
chose plain steps in 99% of its rounds.)

Batch invariance: the same seeded requests run one at a time and then all at once; the
share whose tokens are identical. Random draws are keyed by (seed, position, purpose), so
tokens differ only where a batched forward's float reductions moved a draw across a
boundary (or flipped a near-tie).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from bench_drafters import SETS  # this folder is on the path of `python bench/...`
from bench_one_host import start_server

from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

# --modes name: (the table's label, the request's options)
MODES = {
    "plain": ("non-speculative PoE", {"rule": "verifier_only"}),
    "head": ("speculative PoE, head γ=4", {"drafter": "head", "gamma": 4}),
    "auto": ("automatic drafter", {"drafter": "auto"}),
}
SERVERS = ("split", "serve")


@contextmanager
def started(server: str, checkpoint: str, args: list[str]) -> Iterator[str]:
    """The Generation address of a server on free loopback ports, stopped afterwards:
    the split stack (trunk, two shards, orchestrator; `args` to the services) or
    `hydra-jury serve` (`args` to it)."""
    if server == "split":
        stack = LocalStack(checkpoint, shards=2, port=0, extra_service_args=args)
        try:
            yield stack.start()
        finally:
            stack.stop()
        return
    child = start_server(checkpoint, args)
    try:
        if not child.address:
            raise RuntimeError(child.failure)
        yield child.address
    finally:
        child.process.terminate()
        child.process.wait(timeout=60)


def drafter_mix(rounds: Counter) -> str:
    """Rounds by who drafted them, most first: "1010 plain steps (98.7%), 13 prompt
    lookup (1.3%)"."""
    names = {"none": "plain steps", "ngram": "prompt lookup", "head": "head drafts"}
    total = sum(rounds.values())
    return ", ".join(
        f"{count} {names.get(drafter, drafter)} ({100 * count / total:.1f}%)"
        for drafter, count in rounds.most_common()
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sampled(prompts: list[str], index: int, new_tokens: int, options: dict, prompt_shift: int = 0):
    return request_to_pb(
        GenerationRequest(
            messages=[{"role": "user", "content": prompts[(index + prompt_shift) % len(prompts)]}],
            max_new_tokens=new_tokens,
            ignore_eos=True,
            temperature=0.8,
            seed=index,
            **options,
        )
    )


def rounds_of(message) -> Counter:
    """The rounds of a finished request by who drafted them ("none": a plain step), from
    its last message's statistics."""
    if not message.HasField("stats"):
        return Counter()
    return Counter(dict(message.stats.rounds_by_drafter))


def timed(stub, request) -> tuple[list[int], float, float, Counter]:
    """The request's tokens, time to first token, time per output token after it, and
    its rounds by drafter."""
    began = time.perf_counter()
    first, tokens, rounds = None, [], Counter()
    for message in stub.GenerateStream(request, timeout=900):
        if message.tokens and first is None:
            first = time.perf_counter()
        tokens += [token.token_id for token in message.tokens]
        rounds = rounds_of(message) or rounds
    ended = time.perf_counter()
    return tokens, first - began, (ended - first) / max(1, len(tokens) - 1), rounds


# A sustained setting's request that a full server refuses (RESOURCE_EXHAUSTED) is sent
# again after this long, as a client following the retry hint would: right after a
# setting, the streams it cancelled at its deadline still hold their slots for a round.
RETRY_AFTER_S = 0.05


def until(
    stub, request, deadline: float, refusals: list[int]
) -> tuple[int, tuple[float, float] | None, Counter]:
    """The tokens of `request` streamed before `deadline` (perf_counter seconds), and,
    if it finished by then, its time to first token and per output token after it and
    its rounds by drafter (a request still running at the deadline is cancelled). A
    refusal for a full server before the first token is counted in `refusals` and the
    request sent again, the wait included in its time to first token."""
    began = time.perf_counter()
    while True:
        try:
            return _streamed(stub, request, deadline, began)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refusals.append(1)
            if time.perf_counter() + RETRY_AFTER_S >= deadline:
                return 0, None, Counter()
            time.sleep(RETRY_AFTER_S)


def _streamed(
    stub, request, deadline: float, began: float
) -> tuple[int, tuple[float, float] | None, Counter]:
    first, tokens, rounds = None, 0, Counter()
    stream = stub.GenerateStream(request, timeout=900)
    for message in stream:
        now = time.perf_counter()
        if now >= deadline:
            stream.cancel()
            return tokens, None, Counter()
        if message.tokens and first is None:
            first = now
        tokens += len(message.tokens)
        rounds = rounds_of(message) or rounds
    ended = time.perf_counter()
    return tokens, (first - began, (ended - first) / max(1, tokens - 1)), rounds


def measure(
    address: str,
    sessions: int,
    requests: int,
    new_tokens: int,
    options: dict,
    prompts: list[str],
    duration: float | None = None,
    stagger: bool = False,
):
    """Aggregate tokens/s, TTFTs, TPOTs and rounds by drafter of `sessions` in a closed
    loop: `requests` each, over the wall time until the last ends; or with `duration`,
    requests until `duration` seconds have passed, over the tokens streamed by then (a
    session that finishes early starts its next request, so the batches stay as full as
    the load; the rounds are those of the requests that finished).
    With `stagger`, session i's first request asks for (i + 1) / sessions of
    `new_tokens`, so that from then on the sessions' requests end at times spread over
    a request's length, in every mode alike, as independent users' do (otherwise
    every non-speculative request starts and ends in step with the others)."""
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    counts: list[int] = []
    latencies: list[tuple[float, float]] = []
    refusals: list[int] = []
    rounds: list[Counter] = []  # each finished request's
    began = time.perf_counter()
    deadline = None if duration is None else began + duration

    def more(turn: int) -> bool:
        return turn < requests if deadline is None else time.perf_counter() < deadline

    def session_loop(index: int) -> None:
        turn = 0
        while more(turn):
            length = new_tokens
            if stagger and turn == 0:
                length = max(1, round(new_tokens * (index + 1) / sessions))
            request = sampled(prompts, index, length, options, turn)
            if deadline is None:
                tokens, ttft, tpot, drafters = timed(stub, request)
                counts.append(len(tokens))
                latencies.append((ttft, tpot))
            else:
                count, latency, drafters = until(stub, request, deadline, refusals)
                counts.append(count)
                if latency is not None:
                    latencies.append(latency)
            rounds.append(drafters)
            turn += 1

    threads = [threading.Thread(target=session_loop, args=(i,)) for i in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began if duration is None else duration
    channel.close()
    if refusals:
        print(
            f"bench_serving: {sessions} sessions, {len(refusals)} requests refused for a "
            "full server and sent again",
            file=sys.stderr,
        )
    ttfts, tpots = [ttft for ttft, _ in latencies], [tpot for _, tpot in latencies]
    return sum(counts) / wall, ttfts, tpots, sum(rounds, Counter())


def invariance(
    address: str, count: int, new_tokens: int, options: dict, prompts: list[str]
) -> tuple[int, int]:
    """(identical, count): seeded requests alone, then all `count` at once."""
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    requests = [sampled(prompts, index, new_tokens, options) for index in range(count)]
    alone = [timed(stub, request)[0] for request in requests]
    together: list[list[int]] = [[] for _ in requests]

    def run(index: int) -> None:
        together[index] = timed(stub, requests[index])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    return sum(a == b for a, b in zip(alone, together, strict=True)), count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--sessions", default="1,2,4,8,16", help="comma-separated counts")
    parser.add_argument("--requests", type=int, default=1, help="requests per session")
    parser.add_argument(
        "--duration",
        type=float,
        help="seconds of sustained load: each session sends requests until then, and the "
        "tokens streamed by then count (instead of --requests each, timed to the last)",
    )
    parser.add_argument(
        "--stagger",
        action="store_true",
        help="with --duration: the sessions' first requests of 1/N, 2/N, .. N/N of "
        "--new-tokens, so that their requests end at spread times in every mode",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts",
        choices=sorted(SETS),
        default="open",
        help="the prompts the requests cycle through: open (free chat, as in the drafters' "
        "benchmark) or extractive (copying from the prompt, where prompt lookup pays)",
    )
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument(
        "--invariance-requests",
        type=int,
        default=16,
        help="seeded requests run alone and together, per mode and dtype (0: skip)",
    )
    parser.add_argument(
        "--unbatched", action="store_true", help="also measure one call per forward"
    )
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help="comma-separated: split, serve"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every setting this many times, the modes in turn at each session count, "
        "and report medians (and the automatic drafter against the best fixed mode)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.stagger and not args.duration:
        parser.error("--stagger needs --duration (sustained load)")
    counts = [int(count) for count in args.sessions.split(",")]
    modes = dict(MODES[name] for name in args.modes.split(","))
    print(
        f"{os.cpu_count()} cores, {args.checkpoint}, the split stack (trunk, 2 shards, "
        f"orchestrator) and serve, {args.prompts} prompts, {args.new_tokens} new tokens, "
        "T = 0.8 seeded, "
        + (
            f"requests for {args.duration:g} s per setting (sustained closed loop"
            + (", staggered)" if args.stagger else ")")
            if args.duration
            else f"{args.requests} request(s) per session (closed loop)"
        )
    )
    print(
        "| server | dtype | batching | mode | sessions | tokens/s | × one session | "
        "TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    settings = [("batched", [])]
    if args.unbatched:
        settings.append(("one call per forward", ["--max-batch-tokens", "1"]))
    notes: list[str] = []  # batch invariance, and the automatic drafter side by side
    for server in args.servers.split(","):
        for dtype in args.dtypes.split(","):
            for services, limit in settings:
                with started(server, args.checkpoint, ["--dtype", dtype, *limit]) as address:
                    label = f"{server}, {dtype}"
                    rows = run_modes(address, modes, counts, args, notes, label)
                    for name, count, rate, single, ttft, tpot, rounds in rows:
                        if name == MODES["auto"][0] and rounds:
                            notes.append(
                                f"{label}, {count} sessions: {name}'s rounds, {drafter_mix(rounds)}"
                            )
                        print(
                            f"| {server} | {dtype} | {services} | {name} | {count} | "
                            f"{rate:.1f} | {rate / single:.2f} | "
                            f"{1000 * statistics.median(ttft):.0f} / "
                            f"{1000 * percentile(ttft, 0.95):.0f} | "
                            f"{1000 * statistics.median(tpot):.0f} / "
                            f"{1000 * percentile(tpot, 0.95):.0f} |",
                            flush=True,
                        )
                    if services == "batched" and args.invariance_requests:
                        for name, options in modes.items():
                            same, total = invariance(
                                address,
                                args.invariance_requests,
                                args.new_tokens,
                                options,
                                SETS[args.prompts],
                            )
                            notes.append(
                                f"{server}, {dtype}, {name}: {same} of {total} requests "
                                f"identical alone and in a batch of {total}"
                            )
    for line in notes:
        print(line)
    return 0


def run_modes(
    address: str, modes: dict, counts: list[int], args, notes: list[str], label: str
) -> Iterator[tuple]:
    """(mode, sessions, tokens/s, one session's tokens/s, TTFTs, TPOTs, rounds by drafter)
    of every mode and session count, in order, after a warm-up. With `--repeats` N > 1
    the settings run in turn instead, every mode at one session count before the next
    count (in reverse order every other time), N times over: the modes compared at a
    count run within a minute of each other, so that a machine whose speed drifts weighs
    on them alike. Each row's tokens/s is then the median of its N runs, and its
    latencies and rounds pool theirs; `notes` gets, per count, the automatic drafter
    against the best fixed mode, run by run (`label` names the server and dtype)."""
    prompts = SETS[args.prompts]
    measure(address, 1, 1, 8, MODES["plain"][1], prompts)

    def one(count: int, options: dict) -> tuple:
        return measure(
            address,
            count,
            args.requests,
            args.new_tokens,
            options,
            prompts,
            args.duration,
            args.stagger,
        )

    if args.repeats == 1:
        for name, options in modes.items():
            single = None
            for count in counts:
                rate, ttft, tpot, rounds = one(count, options)
                single = single or rate
                yield name, count, rate, single, ttft, tpot, rounds
        return
    runs: dict[tuple[str, int], list[tuple]] = {}
    for repeat in range(args.repeats):
        for count in counts:
            # The modes' order turns round every repeat: the second of two runs side by
            # side can be slower for being second (the server's and Redis's state).
            ordered = list(modes.items())[:: -1 if repeat % 2 else 1]
            for name, options in ordered:
                runs.setdefault((name, count), []).append(one(count, options))
    rates = {key: [rate for rate, *_ in measured] for key, measured in runs.items()}
    for name in modes:
        single = statistics.median(rates[name, counts[0]])
        for count in counts:
            measured = runs[name, count]
            ttft = [t for _, ttfts, _, _ in measured for t in ttfts]
            tpot = [t for _, _, tpots, _ in measured for t in tpots]
            rounds = sum((drafters for *_, drafters in measured), Counter())
            yield name, count, statistics.median(rates[name, count]), single, ttft, tpot, rounds
    automatic = MODES["auto"][0]
    fixed = [name for name in modes if name != automatic]
    if automatic in modes and fixed:
        for count in counts:  # repeat by repeat: the runs of one repeat ran side by side
            ratios = [
                rates[automatic, count][i] / max(rates[name, count][i] for name in fixed)
                for i in range(args.repeats)
            ]
            notes.append(
                f"{label}, {count} sessions: {automatic} against the best of "
                f"{', '.join(fixed)}: {statistics.median(ratios):.2f}x "
                f"(median of {args.repeats} runs side by side; "
                f"{min(ratios):.2f}-{max(ratios):.2f})"
            )


if __name__ == "__main__":
    raise SystemExit(main())
