"""What a few small tensor operations cost right after a large buffer has streamed
through the caches, as a decode step's weights do: why the engine's Python costs tens of
µs a line between two model steps while the same lines take a few µs in a loop.

    python bench/bench_cold_cache.py

For each buffer size, the buffer is summed (read once, end to end) and then the
operations run once and are timed: median of `--repeats`. "warm" runs them again right
after, with nothing in between. The operations are those a plain decoding round does
between two model steps: a one-element tensor made from a token id, a row of hidden
states copied into a session's buffer, a small tensor turned into a list, a slice.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

HIDDEN = 576  # SmolLM2-135M's hidden size


def operations() -> dict[str, Callable[[], object]]:
    tokens = torch.zeros(4096, dtype=torch.long)
    hidden = torch.zeros(4096, HIDDEN)
    row = torch.ones(1, HIDDEN)
    votes = torch.zeros(1, 4, dtype=torch.long)

    def factory():
        return torch.tensor([5])

    def row_copy():
        hidden[7:8] = row

    def to_list():
        return votes.tolist()

    def view():
        return row[0]

    def all_four():
        tokens[7:8] = factory()
        row_copy()
        to_list()
        return view()

    return {
        "tensor([token])": factory,
        "hidden[s:e] = row": row_copy,
        "tolist()": to_list,
        "row[0]": view,
        "all four": all_four,
    }


def cold_and_warm(
    buffer: torch.Tensor, op: Callable[[], object], repeats: int
) -> tuple[float, float]:
    cold, warm = [], []
    for _ in range(repeats):
        buffer.sum()
        began = time.perf_counter()
        op()
        middle = time.perf_counter()
        op()
        cold.append(middle - began)
        warm.append(time.perf_counter() - middle)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="0.5,4,16,32,64,200", help="buffer sizes, MiB")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads; µs, median of {args.repeats}"
    )
    ops = operations()
    print("| streamed before | " + " | ".join(ops) + " | warm (all four) |")
    print("| --- |" + " --- |" * (len(ops) + 1))
    for size in (float(s) for s in args.sizes_mb.split(",")):
        buffer = torch.ones(int(size * 2**20) // 4)
        cells, warm_all = [], 0.0
        for name, op in ops.items():
            cold, warm = cold_and_warm(buffer, op, args.repeats)
            cells.append(f"{cold * 1e6:.1f}")
            if name == "all four":
                warm_all = warm
        print(f"| {size:g} MiB | " + " | ".join(cells) + f" | {warm_all * 1e6:.1f} |")


if __name__ == "__main__":
    main()
