"""In-process decoding modes on the demo checkpoint: single head, non-speculative PoE and
speculative PoE with several draft lengths, in one run.

    python bench/bench_engine.py --checkpoint var/models/smollm2-hydra
    python bench/bench_engine.py --checkpoint var/models/smollm2-hydra --top-p 0.9

Per mode: tokens/s; trunk-layer and head-layer weight passes per emitted token (a
forward call reads each layer's weights once, whatever the number of positions or
stacked heads it covers: a call of the 4-head stack over 4 head layers is 16 head-layer
passes); acceptance rate; mean accepted length (tokens committed per round); and the
share of wall time spent outside model forward passes (loop, sampling, metrics,
tokenizer, bookkeeping), from timers around the trunk's and the head stack's ragged
forward and fill.
"""

from __future__ import annotations

import argparse
import time

import torch
from round_profile import PhaseProfiler

from hydra_jury.hydra_model import HydraModel
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.workers.sessions import SessionLimits

PROMPT = "Write a short story about a robot who learns to paint."
MODES = [
    ("single head (drafter_only, γ=4)", {"rule": "drafter_only", "gamma": 4}),
    ("PoE, non-speculative (verifier_only)", {"rule": "verifier_only"}),
    ("speculative PoE γ=2", {"rule": "exact", "gamma": 2, "drafter": "head"}),
    ("speculative PoE γ=4", {"rule": "exact", "gamma": 4, "drafter": "head"}),
    ("speculative PoE γ=6", {"rule": "exact", "gamma": 6, "drafter": "head"}),
]


def run_mode(
    model: HydraModel, tokenizer, options: dict, new_tokens: int, sampling: dict, seed: int
) -> dict:
    backend = LocalBackend(model, limits=SessionLimits(1, 1024))
    engine = Engine(backend, tokenizer)
    request = GenerationRequest(
        messages=[{"role": "user", "content": PROMPT}],
        max_new_tokens=new_tokens,
        ignore_eos=True,
        seed=seed,
        **sampling,
        **options,
    )
    engine.generate(GenerationRequest(**{**vars(request), "max_new_tokens": 8}))  # warm-up
    trunk_before = vars(backend.trunk.counters).copy()
    jury_before = backend.jury.counters.head_runs
    profiler = PhaseProfiler()
    with profiler.installed():
        began = time.perf_counter()
        output = engine.generate(request)
        wall = time.perf_counter() - began
    trunk_layers = model.manifest.trunk_layers
    head_layers = model.config.num_layers - trunk_layers
    trunk_calls = backend.trunk.counters.trunk_calls - trunk_before["trunk_calls"]
    draft_calls = backend.trunk.counters.draft_head_calls - trunk_before["draft_head_calls"]
    jury_heads = backend.jury.counters.head_runs - jury_before
    emitted = len(output.token_ids)
    stats = output.stats
    return {
        "tokens_per_s": emitted / wall,
        "trunk_passes": trunk_calls * trunk_layers / emitted,
        "head_passes": (draft_calls + jury_heads) * head_layers / emitted,
        "acceptance": stats["acceptance_rate"] if stats["drafted"] else None,
        "mean_length": stats["mean_accepted_length"],
        "overhead": profiler.outside_forward(wall),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = HydraModel.load(args.checkpoint, device=args.device)
    tokenizer = model.load_tokenizer()
    print(
        f"in-process decoding, {model.manifest.source.split('/')[-1]}, "
        f"{len(model.head_names)} heads, trunk {model.manifest.trunk_layers} layers, "
        f"{args.new_tokens} new tokens, temperature {args.temperature}, top-k {args.top_k}, "
        f"top-p {args.top_p}, seed {args.seed}, "
        f"{args.device}, {torch.get_num_threads()} threads"
    )
    header = (
        f"| {'mode':<38} | tokens/s | trunk-layer passes/token | head-layer "
        f"passes/token | acceptance | mean accepted length | outside forward |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for name, options in MODES:
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
        row = run_mode(model, tokenizer, options, args.new_tokens, sampling, args.seed)
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(
            f"| {name:<38} | {row['tokens_per_s']:8.1f} | {row['trunk_passes']:24.1f} | "
            f"{row['head_passes']:23.1f} | {acceptance:>10} | {row['mean_length']:20.2f} | "
            f"{row['overhead']:15.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
