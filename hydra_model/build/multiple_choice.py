"""A multiple-choice set the project writes itself, answered and graded by the model.

- questions: small facts a program can check (sums, differences, the larger of two
  numbers, the day or month after another), each with four options A-D in a seeded
  order, and the instruction to reply with the letter.
- answers: the checkpoint's own, greedy non-speculative PoE over every `llm` head (the
  product of their distributions), after the question in the chat template.
- grading: an answer is correct when it starts with the right letter (or, failing a
  letter, names the right option's text); anything else is wrong.

Each example then carries what the uncertainty head reads (`hydra_model.uncertainty`):
the witness hidden state and the trunk's outputs over the check prompt.
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from hydra_jury.hydra_model.build.demo_corpus import continue_prompts, greedy_product
from hydra_jury.hydra_model.model import HydraModel
from hydra_jury.hydra_model.uncertainty import (
    check_hiddens,
    check_tokens,
    user_turn_tokens,
    witness_from,
)

LETTERS = "ABCD"
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
ANSWER_TOKENS = 12  # a letter and the option, or the option worked out ("4 + 5 = 9")
ANSWER_BATCH = 32  # questions answered together


@dataclass(frozen=True)
class Question:
    text: str  # the question with its options and the instruction
    correct: str  # the right letter


@dataclass(frozen=True)
class Example:
    question: Question
    answer: str
    correct: bool
    hidden: torch.Tensor  # [T, D] the uncertainty head's input (check prompt + witness)


def _fact(rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, right option, three wrong options)."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        right = a + b
        return f"What is {a} + {b}?", str(right), [str(right + d) for d in (-2, 1, 10)]
    if kind == 1:
        a, b = rng.randint(20, 99), rng.randint(1, 19)
        right = a - b
        return f"What is {a} - {b}?", str(right), [str(right + d) for d in (-1, 2, -10)]
    if kind == 2:
        numbers = rng.sample(range(10, 1000), 4)
        return (
            "Which number is the largest?",
            str(max(numbers)),
            [str(n) for n in numbers if n != max(numbers)],
        )
    names = DAYS if kind == 3 else MONTHS
    index = rng.randrange(len(names))
    right = names[(index + 1) % len(names)]
    wrong = rng.sample([n for n in names if n not in (right, names[index])], 3)
    what = "day" if kind == 3 else "month"
    return f"Which {what} comes right after {names[index]}?", right, wrong


def make_questions(count: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        stem, right, wrong = _fact(rng)
        options = [right, *wrong]
        rng.shuffle(options)
        listed = "\n".join(f"{letter}) {o}" for letter, o in zip(LETTERS, options, strict=True))
        text = f"{stem}\n{listed}\nReply with the letter of the right option."
        questions.append(Question(text, LETTERS[options.index(right)]))
    return questions


def grade(question: Question, answer: str) -> bool:
    letter = re.match(r"\s*\(?([A-D])\b", answer)
    if letter:
        return letter[1] == question.correct
    right = re.search(rf"^{question.correct}\) (.+)$", question.text, re.MULTILINE)
    return bool(right) and re.search(rf"(?<!\w){re.escape(right[1])}(?!\w)", answer) is not None


def answer_and_grade(model: HydraModel, questions: list[Question]) -> list[Example]:
    """The model's greedy PoE answer to each question, graded, with the uncertainty
    head's input for it; `ANSWER_BATCH` questions at a time, each pass one ragged batch."""
    tokenizer = model.load_tokenizer()
    examples = []
    with tqdm(total=len(questions), desc="answering", unit="question", file=sys.stderr) as bar:
        for first in range(0, len(questions), ANSWER_BATCH):
            batch = questions[first : first + ANSWER_BATCH]
            examples += _answered(model, tokenizer, batch)
            bar.update(len(batch))
    return examples


def _answered(model: HydraModel, tokenizer, batch: list[Question]) -> list[Example]:
    prompts = [user_turn_tokens(tokenizer, q.text) for q in batch]
    answered = continue_prompts(model, model.heads, prompts, ANSWER_TOKENS, greedy_product)
    texts = [tokenizer.decode(answer, skip_special_tokens=True) for answer in answered.tokens]
    # The prefill that chose each answer's first token holds its witness.
    witnesses = [
        witness_from(answered.first_logits[:, i], answered.first_states[:, i], answer[0])
        for i, answer in enumerate(answered.tokens)
    ]
    checks = [
        torch.tensor(check_tokens(tokenizer, q.text, text))
        for q, text in zip(batch, texts, strict=True)
    ]
    hiddens = check_hiddens(model, checks, [w.hidden for w in witnesses])
    # Cloned out of inference mode: training reads them in the backward pass.
    return [
        Example(question, text, grade(question, text), hidden.clone())
        for question, text, hidden in zip(batch, texts, hiddens, strict=True)
    ]
