"""What quantization costs in quality: perplexity on held-out text and greedy agreement
with float32, for float32, bfloat16, int8 (with the output matrix quantized and kept
float) and int4, each with int8 activations (the default) and float ones, on the demo
split (SmolLM2-135M-Instruct, trunk and head0).

    python bench/bench_quality.py --checkpoint var/models/smollm2-base

Held-out text: every fourth text of the demo corpus (`make model` writes it; SmolLM2's own
answers to the demo prompts). The untrained split's heads are SmolLM2's own top layers, so
no text of the corpus was ever trained on by this checkpoint. That text was sampled from
float32 at T = 0.8, sharper than float32's own distribution, and a perturbed model can fit
it better than float32 does; so perplexity is also measured on human-written text
(`--written`, by default licence texts that Debian and CPython install: the GPL-3 and
Apache-2.0 texts and Python's LICENSE.txt, those present), cut into pieces of 256 tokens.
"Same argmax": on the held-out text (teacher-forced, every position sees the true
context), how often a variant's most likely next token is float32's. Greedy agreement: 8
chat prompts x 128 new tokens, decoded by each variant; "same tokens" counts the positions
where a variant's token equals float32's, "same prefix" the tokens before the first
difference (after it, the contexts differ, so later positions agree only by chance).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from bench_model import ours

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.corpus import read_corpus
from hydra_jury.hydra_model.build.demo import CORPUS_FILE
from hydra_jury.hydra_model.build.quantize import quantize_checkpoint
from hydra_jury.hydra_model.quantization import QuantizationScheme

# name -> (quantization flags: method, group size, keep the output matrix, activations; or
# None for float; the compute dtype)
VARIANTS = {
    "float32": (None, "float32"),
    "bfloat16": (None, "bfloat16"),
    "int8": (("int8", 0, False, "int8"), "float32"),
    "int8, output float": (("int8", 0, True, "int8"), "float32"),
    "int4 (groups of 32)": (("int4", 32, False, "int8"), "float32"),
    "int8, float acts": (("int8", 0, False, "float"), "float32"),
    "int4, float acts": (("int4", 32, False, "float"), "float32"),
}
WRITTEN_TEXTS = [
    Path("/usr/share/common-licenses/GPL-3"),
    Path("/usr/share/common-licenses/Apache-2.0"),
    Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
]
PIECE_TOKENS = 256
PIECES_PER_TEXT = 12
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe the water cycle in a few sentences.",
    "Write a haiku about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "Summarize the plot of Romeo and Juliet.",
]


def quantized_variants(base: Path, root: Path) -> dict[str, Path]:
    """Quantized copies of `base` under `root` (made once, then reused): name -> path."""
    paths = {}
    for name, (flags, _) in VARIANTS.items():
        if flags is None:
            paths[name] = base
            continue
        method, group_size, keep_output, activations = flags
        path = root / f"{method}{'-g' + str(group_size) if group_size else ''}"
        path = path.with_name(
            path.name + ("-output-float" if keep_output else "") + f"-{activations}-activations"
        )
        if not (path / "hydra.json").is_file():
            scheme = QuantizationScheme.from_flags(method, group_size, keep_output, activations)
            quantize_checkpoint(base, path, scheme, force=True, log=lambda line: None)
        paths[name] = path
    return paths


@torch.inference_mode()
def held_out_scores(model: HydraModel, texts: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """Perplexity of head0 over every token of `texts` (exp of the mean next-token loss),
    and its argmax at every position of each text."""
    head = model.heads.select(0)
    total, count, choices = 0.0, 0, []
    for tokens in texts:
        ids = torch.tensor(tokens)
        capacity = len(tokens)
        hidden = model.trunk.forward(ids, model.trunk_cache(capacity), 0)
        logits = head.forward(hidden, model.head_cache(1, capacity), 0)[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
        count += len(tokens) - 1
        choices.append(logits.argmax(-1))
    return math.exp(total / count), choices


def pieces(tokenizer, paths: list[Path]) -> list[list[int]]:
    """Each text's first `PIECES_PER_TEXT` pieces of `PIECE_TOKENS` tokens."""
    cut = []
    for path in paths:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        ends = range(PIECE_TOKENS, min(len(ids), PIECE_TOKENS * PIECES_PER_TEXT) + 1, PIECE_TOKENS)
        cut += [ids[end - PIECE_TOKENS : end] for end in ends]
    return cut


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[int, int, int]:
    """(same tokens, same prefix, all tokens) summed over the prompts."""
    same = prefix = total = 0
    for ref, got in zip(reference, tokens, strict=True):
        same += sum(a == b for a, b in zip(ref, got, strict=True))
        pairs = enumerate(zip(ref, got, strict=True))
        prefix += next((i for i, (a, b) in pairs if a != b), len(ref))
        total += len(ref)
    return same, prefix, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("var/models/smollm2-base"))
    parser.add_argument("--variants-dir", type=Path, default=Path("var/models/quantized"))
    parser.add_argument("--corpus", type=Path, default=CORPUS_FILE)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--written",
        type=Path,
        action="append",
        help="a human-written text to measure perplexity on (repeatable; default: the "
        "licence texts of WRITTEN_TEXTS that this machine has)",
    )
    args = parser.parse_args()
    written_paths = args.written or [path for path in WRITTEN_TEXTS if path.is_file()]
    paths = quantized_variants(args.checkpoint, args.variants_dir)
    tokenizer = HydraModel.load(args.checkpoint, heads=["head0"]).load_tokenizer()
    held_out = [tokenizer.encode(text) for text in read_corpus(args.corpus)[3::4]]
    written = pieces(tokenizer, written_paths)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for p in PROMPTS
    ]
    print(
        f"SmolLM2-135M-Instruct (trunk + head0), perplexity over {len(held_out)} held-out "
        f"texts ({sum(len(t) for t in held_out)} tokens) and {len(written)} pieces of "
        f"human-written text ({', '.join(path.name for path in written_paths)}; "
        f"{sum(len(t) for t in written)} tokens); greedy agreement with float32 over "
        f"{len(prompts)} prompts x {args.new_tokens} tokens"
    )
    columns = (
        "perplexity",
        "vs float32",
        "written",
        "vs float32",
        "same argmax",
        "same tokens",
        "same prefix",
    )
    print(f"{'weights':<22}{columns[0]:>11}" + "".join(f"{c:>13}" for c in columns[1:]))
    reference = None
    for name, (_, dtype) in VARIANTS.items():
        model = HydraModel.load(paths[name], dtype=dtype, heads=["head0"])
        ppl, choices = held_out_scores(model, held_out)
        written_ppl = held_out_scores(model, written)[0] if written else math.nan
        tokens = [ours(model, prompt, args.new_tokens)[0] for prompt in prompts]
        if reference is None:
            reference = ppl, torch.cat(choices), tokens, written_ppl
        same_argmax = (torch.cat(choices) == reference[1]).float().mean().item()
        same, prefix, total = agreement(reference[2], tokens)
        print(
            f"{name:<22}{ppl:>11.3f}{(ppl / reference[0] - 1) * 100:>+12.2f}%"
            f"{written_ppl:>13.3f}{(written_ppl / reference[3] - 1) * 100:>+12.2f}%"
            f"{same_argmax:>13.1%}{same / total:>13.1%}{prefix / total:>13.1%}"
        )


if __name__ == "__main__":
    main()
