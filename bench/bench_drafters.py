"""Drafters side by side on the demo checkpoint: non-speculative PoE, speculative PoE
drafted by a head, by prompt lookup (n-gram) and by the demo draft model (SmolLM2's
first layers; both one-pass verification with a bonus token), for γ in {2, 4, 8}, and
the automatic mode, on two prompt sets, in-process and over the split stack.

    python bench/bench_drafters.py --checkpoint var/models/smollm2-hydra \
        --draft-model var/models/smollm2-draft

- extractive: the answer copies from the prompt (rewrite, quote, fix a typo in a given
  paragraph or code); prompt lookup finds its drafts there.
- open: free chat; little to copy.
Greedy decoding (temperature 0) with the exact rule, so every mode must give the same
tokens for a prompt (checked): the modes differ only in speed. Per mode and set: tokens/s
(all the set's tokens over all its wall time), acceptance (kept / drafted), mean tokens
per round, and verification passes (jury calls) per token.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import grpc

from hydra_jury.cli.generate import LOCAL_LIMITS
from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

PARAGRAPH = (
    "The harbour town wakes early. Fishing boats leave before dawn, and by seven the "
    "market is full of voices, crates of silver fish and the smell of coffee from the "
    "stall by the church."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n"
    "        total += value\n    return totl / len(values)\n"
)
EXTRACTIVE = [
    f"Repeat this paragraph exactly:\n\n{PARAGRAPH}",
    f"Fix the typo in this code and return the whole corrected code:\n\n{CODE}",
    f"Quote the second sentence of this paragraph:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph in the past tense:\n\n{PARAGRAPH}",
    "Correct the spelling and return the full text: 'Teh quick brown fox jumpd over the "
    "lazy dog, and then the quick brown fox ran bakc into the forest.'",
    f"Add a docstring to this function and return the complete function:\n\n{CODE}",
    "Turn this list into a numbered list, keeping every item: apples, pears, plums, "
    "cherries, grapes, lemons, limes, oranges.",
    f"Copy this paragraph and put each sentence on its own line:\n\n{PARAGRAPH}",
]
OPEN = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Tell me a short story about a robot who learns to paint.",
    "What should I pack for a weekend hike?",
    "Explain what a neural network is to a child.",
    "Suggest a name for a small bakery.",
]
SETS = {"extractive": EXTRACTIVE, "open": OPEN}
BASELINE = "non-speculative PoE"
# A head drafter leaves itself out of the jury, so its target is the product of the
# other heads: its tokens are checked against non-speculative PoE over that jury.
DRAFT_HEAD = "head0"
HEAD_BASELINE = f"non-speculative PoE, jury without {DRAFT_HEAD}"
MODES = {
    BASELINE: {"rule": "verifier_only"},
    HEAD_BASELINE: {"rule": "verifier_only"},  # its jury is set from the checkpoint
    **{f"head γ={g}": {"gamma": g, "drafter": "head", "draft_head": DRAFT_HEAD} for g in (2, 4, 8)},
    **{f"ngram γ={g}": {"gamma": g, "drafter": "ngram"} for g in (2, 4, 8)},
    **{f"model γ={g}": {"gamma": g, "drafter": "model"} for g in (2, 4, 8)},
    "auto": {"drafter": "auto"},
}


def reference_of(mode: str) -> str:
    """The non-speculative mode whose tokens `mode` must reproduce (greedy, exact)."""
    if mode.startswith("head") or mode == HEAD_BASELINE:
        return HEAD_BASELINE
    return BASELINE


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, token_ids: list[int], seconds: float, stats) -> None:
        self.tokens += len(token_ids)
        self.seconds += seconds
        self.drafted += stats["drafted"]
        self.accepted += stats["accepted"]
        self.rounds += stats["rounds"]
        self.outputs.append(list(token_ids))

    def row(self, name: str, baseline: float) -> str:
        rate = self.tokens / self.seconds
        acceptance = f"{self.accepted / self.drafted:.2f}" if self.drafted else "–"
        return (
            f"| {name} | {rate:.1f} | {rate / baseline:.2f}× | {acceptance} | "
            f"{self.tokens / self.rounds:.2f} | {self.rounds / self.tokens:.2f} |"
        )


def request(prompt: str, new_tokens: int, options: dict) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": prompt}],
        max_new_tokens=new_tokens,
        temperature=0.0,
        seed=0,
        **options,
    )


def in_process(engine: Engine):
    def run(prompt: str, new_tokens: int, options: dict):
        began = time.perf_counter()
        output = engine.generate(request(prompt, new_tokens, options))
        return output.token_ids, time.perf_counter() - began, output.stats

    return run


def over_grpc(address: str):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))

    def run(prompt: str, new_tokens: int, options: dict):
        message = request_to_pb(request(prompt, new_tokens, options))
        began = time.perf_counter()
        response = stub.Generate(message, timeout=600)
        seconds = time.perf_counter() - began
        stats = {"drafted": response.stats.drafted, "accepted": response.stats.accepted}
        stats["rounds"] = response.stats.rounds
        return list(response.token_ids), seconds, stats

    return run


def measure(run, modes: dict, new_tokens: int, title: str) -> None:
    for set_name, prompts in SETS.items():
        run(prompts[0], 8, {"rule": "verifier_only"})  # warm-up
        totals = {name: Totals() for name in modes}
        for prompt in prompts:
            for name, options in modes.items():
                totals[name].add(*run(prompt, new_tokens, options))
        for name, total in totals.items():
            reference = reference_of(name)
            assert total.outputs == totals[reference].outputs, (
                f"{name}: other tokens than {reference}"
            )
        baseline = totals[BASELINE].tokens / totals[BASELINE].seconds
        print(f"\n{title}, {set_name} set ({len(prompts)} prompts)")
        print("| mode | tokens/s | vs non-speculative | acceptance | tokens/round | passes/token |")
        print("|---|---|---|---|---|---|")
        for name, total in totals.items():
            print(total.row(name, baseline), flush=True)


def chosen(names: str) -> dict[str, dict]:
    """The modes named (comma-separated), always with the baseline the ratios need."""
    wanted = [name for name in names.split(",") if name]
    unknown = [name for name in wanted if name not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(MODES)}")
    for name in list(wanted):
        if reference_of(name) not in wanted:
            wanted.insert(0, reference_of(name))
    if wanted and BASELINE not in wanted:
        wanted.insert(0, BASELINE)
    return {name: MODES[name] for name in wanted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument(
        "--draft-model",
        default="var/models/smollm2-draft",
        help="a Hydra checkpoint used as the draft model (`make draft-model`)",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    everything = ",".join(MODES)
    parser.add_argument(
        "--in-process-modes",
        default=everything,
        help="the modes measured in-process (comma-separated; '' for none; default all)",
    )
    parser.add_argument(
        "--grpc-modes",
        default=everything,
        help="the modes measured over the split stack (comma-separated; '' for none; default all)",
    )
    args = parser.parse_args()
    model = HydraModel.load(args.checkpoint)
    MODES[HEAD_BASELINE]["jury"] = [name for name in model.head_names if name != DRAFT_HEAD]
    draft = DraftModel.load(args.draft_model)
    print(
        f"{os.cpu_count()} cores, {args.checkpoint} ({model.dtype}), draft model "
        f"{draft.description}, {args.new_tokens} new tokens, greedy, exact rule; "
        "tokens/s = the set's tokens over its wall time"
    )
    backend = LocalBackend(model, draft_model=draft, limits=LOCAL_LIMITS)
    engine = Engine(backend, model.load_tokenizer())
    in_process_modes = chosen(args.in_process_modes)
    if in_process_modes:
        measure(in_process(engine), in_process_modes, args.new_tokens, "in-process")
    grpc_modes = chosen(args.grpc_modes)
    if grpc_modes:
        del engine, model, draft
        stack = LocalStack(args.checkpoint, shards=2, port=0, draft_model=args.draft_model)
        try:
            measure(over_grpc(stack.start()), grpc_modes, args.new_tokens, "split stack (gRPC)")
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
