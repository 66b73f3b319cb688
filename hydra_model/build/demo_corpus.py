"""The demo training corpus, written by the base model itself: no text is downloaded.

Chat prompts (a few instructions over a list of topics) are answered by sampling the
checkpoint's first head, and each prompt with its answer, in the chat template's format,
is one line of the corpus. Round-robin sharding then gives each head its own topics.
Sampling runs many prompts at once through the runtime's ragged forward, one cache slot
each, with a seeded generator: the same checkpoint and seed give the same corpus.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.model import HydraModel

INSTRUCTIONS = (
    "Write a short paragraph about {}.",
    "Explain {} to a child in a few sentences.",
    "Give three interesting facts about {}.",
    "Describe {} to someone who has never seen it.",
)
TOPICS = (
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon",
    "trains",
    "bread baking",
    "rainforests",
    "the violin",
    "chess",
    "winter",
    "owls",
    "bicycles",
    "lighthouses",
    "coffee",
    "the desert",
    "libraries",
    "thunderstorms",
    "gardening",
    "penguins",
    "the human heart",
    "castles",
    "rivers",
    "football",
    "clouds",
)


def demo_prompts() -> list[str]:
    """Instruction-major, so that round-robin shards split the topics, not the
    instructions."""
    return [instruction.format(topic) for instruction in INSTRUCTIONS for topic in TOPICS]


def chat_prompt(tokenizer, prompt: str) -> str:
    """`prompt` as a user message, with the start of the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def sample_corpus(
    model: HydraModel,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 32,
) -> list[str]:
    """Each prompt, in the chat format, followed by a sampled answer."""
    tokenizer = model.load_tokenizer()
    texts = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    encoded = [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    generator = torch.Generator().manual_seed(seed)
    answers = []
    with tqdm(total=len(encoded), desc="demo corpus", unit="answer", file=sys.stderr) as bar:
        for first in range(0, len(encoded), batch_size):
            group = encoded[first : first + batch_size]
            answers += sample_continuations(model, group, max_new_tokens, temperature, generator)
            bar.update(len(group))
    return [
        text + tokenizer.decode(answer, skip_special_tokens=False)
        for text, answer in zip(texts, answers, strict=True)
    ]


# pick(logits [S, B, V] of the heads for B sequences) -> the next token of each sequence
Pick = Callable[[torch.Tensor], list[int]]


def sampled_from_first_head(temperature: float, generator: torch.Generator) -> Pick:
    def pick(logits: torch.Tensor) -> list[int]:
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()

    return pick


def greedy_product(logits: torch.Tensor) -> list[int]:
    """The argmax of the product of every head's distribution (non-speculative PoE at
    temperature 0)."""
    return torch.log_softmax(logits, dim=-1).sum(0).argmax(-1).tolist()


def sample_continuations(
    model: HydraModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> list[list[int]]:
    """Samples from the first head after each prompt."""
    pick = sampled_from_first_head(temperature, generator)
    return continue_prompts(model, model.heads.select(0), prompts, max_new_tokens, pick).tokens


@dataclass(frozen=True)
class Continuations:
    tokens: list[list[int]]  # each prompt's continuation
    # The heads after each prompt's last token, which chose the first tokens: logits
    # [S, B, V] and last hidden states before the final norm [S, B, D].
    first_logits: torch.Tensor
    first_states: torch.Tensor


@torch.inference_mode()
def continue_prompts(
    model: HydraModel,
    heads: HeadStack,
    prompts: list[list[int]],
    max_new_tokens: int,
    pick: Pick,
) -> Continuations:
    """Continues each prompt, token by token as `pick` chooses from `heads`' logits, all
    prompts in one ragged batch, until an end-of-sequence token (kept) or
    `max_new_tokens`."""
    eos = set(model.config.eos_token_ids)
    capacity = max(len(p) for p in prompts) + max_new_tokens
    trunk_pool = model.trunk_pool(len(prompts), capacity)
    head_pool = model.head_pool(heads.size, len(prompts), capacity)
    caches = [(trunk_pool.acquire(), head_pool.acquire()) for _ in prompts]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p])
    hidden = model.trunk.forward_ragged(
        tokens, [Segment(c[0], 0, len(p)) for c, p in zip(caches, prompts, strict=True)]
    )
    logits, states = heads.forward_ragged(
        hidden,
        [Segment(c[1], 0, len(p)) for c, p in zip(caches, prompts, strict=True)],
        return_hidden=True,
        rows=lengths.cumsum(0) - 1,
    )  # [S, B, V] and [S, B, D]: after each prompt's last token
    first = (logits, states)
    generated: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for step in range(max_new_tokens):
        drawn = pick(logits)
        for index, token in zip(active, drawn, strict=True):
            generated[index].append(token)
        active = [i for i, token in zip(active, drawn, strict=True) if token not in eos]
        if not active or step + 1 == max_new_tokens:
            break
        # Each sequence's newest token sits at its prompt length + step.
        step_tokens = torch.tensor([generated[i][-1] for i in active])
        trunk_segments = [Segment(caches[i][0], len(prompts[i]) + step, 1) for i in active]
        head_segments = [Segment(caches[i][1], len(prompts[i]) + step, 1) for i in active]
        hidden = model.trunk.forward_ragged(step_tokens, trunk_segments)
        logits = heads.forward_ragged(hidden, head_segments)
    return Continuations(generated, *first)
