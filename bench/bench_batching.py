"""The runtime's batched decode step, without services: one step of B sessions (one
token each, contexts of different lengths) through the trunk and the 4-head stack, as
one ragged forward, against B single-session forwards. Float32 and bfloat16.

    python bench/bench_batching.py --checkpoint var/models/smollm2-hydra

The ragged forward must give the hidden states of the single forwards (checked:
relative error of the whole below 1e-5 in float32, 2e-2 in bfloat16). "throughput ×" is
what one ragged forward does against B single ones in the same time: the most that
batching B sessions can give a server whose steps are these.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from hydra_jury.hydra_model import HydraModel, Segment

CONTEXTS = "96,160,224,288,352,416,480,544"  # cycled over the sessions


class Sessions:
    """B sessions with cache slots holding contexts of different lengths."""

    def __init__(self, model: HydraModel, count: int, contexts: list[int]) -> None:
        capacity = max(contexts) + 8
        self.model = model
        self.trunk = model.trunk_pool(count, capacity)
        self.heads = model.head_pool(model.heads.size, count, capacity)
        self.slots = [(self.trunk.acquire(), self.heads.acquire()) for _ in range(count)]
        generator = torch.Generator().manual_seed(0)
        self.lengths = [contexts[i % len(contexts)] for i in range(count)]
        for (trunk_cache, head_cache), length in zip(self.slots, self.lengths, strict=True):
            tokens = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
            hidden = model.trunk.forward(tokens, trunk_cache, 0)
            model.heads.fill_ragged(hidden, [Segment(head_cache, 0, length)])

    def step(self, tokens: torch.Tensor, batched: bool) -> torch.Tensor:
        """One token per session at its context's end (caches rolled back after):
        the heads' last hidden states [4, B, D]."""
        model, out = self.model, []
        groups = (
            [list(range(len(self.slots)))] if batched else [[i] for i in range(len(self.slots))]
        )
        for group in groups:
            trunk_segments = [Segment(self.slots[i][0], self.lengths[i], 1) for i in group]
            head_segments = [Segment(self.slots[i][1], self.lengths[i], 1) for i in group]
            hidden = model.trunk.forward_ragged(tokens[group], trunk_segments)
            _logits, states = model.heads.forward_ragged(hidden, head_segments, return_hidden=True)
            out.append(states)
        for (trunk_cache, head_cache), length in zip(self.slots, self.lengths, strict=True):
            trunk_cache.truncate(length)
            head_cache.truncate(length)
        return torch.cat(out, dim=1)


def timed(function: Callable[..., torch.Tensor], repeats: int, *args) -> tuple[float, torch.Tensor]:
    result = function(*args)  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = function(*args)
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--sessions", default="1,2,4,8,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--contexts", default=CONTEXTS, help="positions each session holds, cycled over them"
    )
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {args.checkpoint}: "
        "one decode step (trunk + 4 heads, one token per session, contexts "
        f"{min(contexts)}..{max(contexts)}), median of {args.repeats}"
    )
    print(
        "| dtype | sessions | B single forwards (ms) | one ragged forward (ms) | "
        "per session (ms) | throughput × |"
    )
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        model = HydraModel.load(args.checkpoint, dtype=dtype)
        for count in (int(c) for c in args.sessions.split(",")):
            sessions = Sessions(model, count, contexts)
            tokens = torch.randint(0, model.config.vocab_size, (count,))
            with torch.inference_mode():
                alone, expected = timed(sessions.step, args.repeats, tokens, False)
                ragged, together = timed(sessions.step, args.repeats, tokens, True)
            tolerance = 1e-5 if dtype == "float32" else 2e-2  # relative, of the whole
            error = (together.float() - expected.float()).norm() / expected.float().norm()
            assert error < tolerance, f"relative error {error:.1e}"
            print(
                f"| {dtype} | {count} | {1000 * alone:.1f} | {1000 * ragged:.1f} | "
                f"{1000 * ragged / count:.1f} | {alone / ragged:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
