"""Greedy single-head decoding: this runtime (trunk + one head) against `transformers`
`generate` on the same SmolLM2 weights, same prompt, same number of tokens.

    python bench/bench_model.py --checkpoint var/models/smollm2-base
"""

from __future__ import annotations

import argparse
import time

import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.demo import demo_gguf_path

PROMPT = "Write a short story about a robot who learns to paint."


def ours(model: HydraModel, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    capacity = len(prompt) + new_tokens
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(1, capacity)
    head = model.heads.select(0)
    began = time.perf_counter()
    tokens, start, generated = torch.tensor(prompt), 0, []
    while len(generated) < new_tokens:
        logits = head.forward(model.trunk.forward(tokens, trunk_cache, start), head_cache, start)
        start += len(tokens)
        generated.append(int(logits[0, -1].argmax()))
        tokens = torch.tensor(generated[-1:])
    return generated, time.perf_counter() - began


def reference(hf_model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    began = time.perf_counter()
    with torch.inference_mode():
        output = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return output[0, len(prompt) :].tolist(), time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-base")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = HydraModel.load(args.checkpoint)
    tokenizer = model.load_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    gguf = demo_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ours(model, prompt, 8)  # warm-up both
    reference(hf_model, prompt, 8)
    best_ours = best_ref = float("inf")
    for _ in range(args.repeats):
        ours_tokens, seconds = ours(model, prompt, args.new_tokens)
        best_ours = min(best_ours, seconds)
        ref_tokens, seconds = reference(hf_model, prompt, args.new_tokens)
        best_ref = min(best_ref, seconds)
    same = sum(a == b for a, b in zip(ours_tokens, ref_tokens, strict=True))
    ours_rate, ref_rate = args.new_tokens / best_ours, args.new_tokens / best_ref
    print(
        f"greedy single-head decoding, SmolLM2-135M-Instruct (trunk 26 + head 4 layers), "
        f"float32, prompt {len(prompt)} tokens, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, best of {args.repeats}"
    )
    print(f"{'runtime':<28}{'tokens/s':>10}")
    print(f"{'hydra_model':<28}{ours_rate:>10.1f}")
    print(f"{'transformers generate':<28}{ref_rate:>10.1f}")
    print(
        f"ratio (hydra / transformers): {ours_rate / ref_rate:.2f}; "
        f"identical tokens: {same}/{args.new_tokens}"
    )


if __name__ == "__main__":
    main()
