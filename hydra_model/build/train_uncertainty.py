"""`hydra-jury train-heads --uncertainty`: the checkpoint's uncertainty head trained to
judge the model's own multiple-choice answers.

1. `multiple_choice` writes `questions` questions, the model answers each (greedy PoE
   over every llm head) and the answers are graded; each example keeps the uncertainty
   head's input (the check prompt's trunk outputs with the witness hidden state).
2. A seeded quarter is held out. The head (full or LoRA, as for the llm heads) is trained
   on the rest with the binary cross-entropy of p_correct = sigmoid(z[A] − z[B]) at the
   last position against the grade, `batch_size` examples a step, in a seeded order.
3. Calibration on the held-out examples before and after: the Brier score (mean of
   (p_correct − correct)²), the accuracy of p_correct > 0.5, and for comparison the
   Brier score of always answering the training set's rate of correct answers.
4. The graded examples are saved once answered, the state every `save_every` steps: an
   interrupted run resumes as `train-heads` does, without answering again;
   at the end `OUT` is the checkpoint with the trained uncertainty head, the calibration
   in `hydra.json` under "uncertainty_training".
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hydra_jury.hydra_model.build.multiple_choice import (
    Example,
    Question,
    answer_and_grade,
    make_questions,
)
from hydra_jury.hydra_model.build.train import (
    CLIP_NORM,
    StepCallback,
    TrainError,
    TrainOptions,
    TrainResult,
    check_options,
    prepare_out,
    training_record,
    write_checkpoint,
)
from hydra_jury.hydra_model.build.train_state import (
    load_examples,
    load_state,
    save_examples,
    save_state,
)
from hydra_jury.hydra_model.build.tuning import TunedHeads
from hydra_jury.hydra_model.checkpoint import checkpoint_fingerprint, read_manifest, read_tensors
from hydra_jury.hydra_model.model import HydraModel
from hydra_jury.hydra_model.uncertainty import UNCERTAINTY_ROLE, verdict_logit, verdict_tokens

HELD_OUT = 0.25  # the share of the questions kept for calibration
MIN_QUESTIONS = 8


@dataclass(frozen=True)
class Calibration:
    brier: float  # mean (p_correct - correct)^2
    accuracy: float  # share of examples where (p_correct > 0.5) == correct
    mean_p: float

    def line(self) -> str:
        return f"Brier {self.brier:.4f}, accuracy {self.accuracy:.3f}, mean p {self.mean_p:.3f}"


@dataclass
class UncertaintyResult(TrainResult):
    questions: int = 0
    correct_rate: float = 0.0  # of the model's answers
    before: Calibration | None = None  # held out, untrained head
    after: Calibration | None = None  # held out, trained head
    constant_brier: float = 0.0  # held out, always the training set's correct rate


def train_uncertainty(
    options: TrainOptions,
    log: Callable[[str], None] = print,
    on_step: StepCallback | None = None,
) -> UncertaintyResult:
    began = time.perf_counter()
    manifest = read_manifest(options.checkpoint)
    check_options(options, manifest)
    if options.questions < MIN_QUESTIONS:
        raise TrainError(f"--questions must be at least {MIN_QUESTIONS}, got {options.questions}")
    specs = [spec for spec in manifest.heads if spec.role == UNCERTAINTY_ROLE]
    if not specs:
        raise TrainError(
            f"{options.checkpoint} has no uncertainty head: build the checkpoint with "
            "`hydra-jury build --uncertainty-head`"
        )
    settings = _settings(options)
    out = Path(options.out)
    resuming = prepare_out(out, settings, options, log)

    model = HydraModel.load(options.checkpoint, dtype="float32")
    try:
        verdict = verdict_tokens(model.load_tokenizer())
    except ValueError as error:
        raise TrainError(f"{options.checkpoint}: {error}") from None
    examples = _graded_examples(model, options, settings, log)
    order = list(range(len(examples)))
    random.Random(options.seed).shuffle(order)
    held_count = max(1, round(HELD_OUT * len(examples)))
    held = [examples[i] for i in order[:held_count]]
    train = [examples[i] for i in order[held_count:]]
    correct_rate = sum(e.correct for e in examples) / len(examples)
    log(f"the model answered {correct_rate:.1%} correctly; {len(held)} held out")

    head_model = HydraModel.load(
        options.checkpoint, dtype="float32", role=UNCERTAINTY_ROLE, load_trunk=False
    )
    base = [
        read_tensors(
            Path(options.checkpoint) / spec.file, manifest.head_shapes(spec), dtype=torch.float32
        )
        for spec in specs
    ]
    tuned = TunedHeads(head_model, base, options.lora_rank, options.seed)
    optimizer = torch.optim.AdamW(list(tuned.parameters.values()), lr=options.lr, weight_decay=0.0)
    before = calibration(tuned, held, verdict)
    losses: list[list[float]] = []
    if resuming:
        losses = load_state(out, tuned.parameters, optimizer)
        log(f"{out}: resuming at step {len(losses)} of {options.steps}")
    resumed_at = len(losses)
    for step in range(resumed_at, options.steps):
        batch = _batch(train, options, step)
        loss = _loss(tuned, batch, verdict)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tuned.head_parameters(0), CLIP_NORM)
        optimizer.step()
        losses.append([loss.item()])
        if (step + 1) % options.save_every == 0 or step + 1 == options.steps:
            save_state(out, settings, tuned.parameters, optimizer, losses)
        if on_step is not None:
            on_step(step + 1, options.steps, losses[-1])
    after = calibration(tuned, held, verdict)
    train_rate = sum(e.correct for e in train) / max(1, len(train))
    constant = sum((train_rate - e.correct) ** 2 for e in held) / len(held)
    record = {
        **training_record(options, losses),
        "questions": len(examples),
        "held_out": len(held),
        "correct_rate": correct_rate,
        "held_out_before": vars(before),
        "held_out_after": vars(after),
        "held_out_constant_brier": constant,
    }
    source = f"train-heads --uncertainty: {len(train)} graded multiple-choice answers"
    write_checkpoint(options, manifest, tuned, [source], ("uncertainty_training", record))
    log(f"wrote {out}")
    return UncertaintyResult(
        out,
        [UNCERTAINTY_ROLE],
        losses,
        resumed_at,
        time.perf_counter() - began,
        questions=len(examples),
        correct_rate=correct_rate,
        before=before,
        after=after,
        constant_brier=constant,
    )


def _graded_examples(
    model: HydraModel, options: TrainOptions, settings: dict[str, Any], log
) -> list[Example]:
    """The questions answered and graded, or those of the interrupted run at `out`."""
    out = Path(options.out)
    saved = load_examples(out, settings)
    if saved is not None:
        log(f"{out}: the {len(saved[0])} graded answers of the interrupted run")
        return [
            Example(Question(r["question"], r["letter"]), r["answer"], r["correct"], hidden)
            for hidden, r in zip(*saved, strict=True)
        ]
    log(f"answering {options.questions} multiple-choice questions (greedy PoE)")
    examples = answer_and_grade(model, make_questions(options.questions, options.seed))
    records = [
        {
            "question": e.question.text,
            "letter": e.question.correct,
            "answer": e.answer,
            "correct": e.correct,
        }
        for e in examples
    ]
    save_examples(out, settings, [e.hidden for e in examples], records)
    return examples


def _settings(options: TrainOptions) -> dict[str, Any]:
    """What decides the run's result (as `train-heads`' settings)."""
    return {
        "checkpoint": checkpoint_fingerprint(options.checkpoint),
        "uncertainty": True,
        "questions": options.questions,
        "lora_rank": options.lora_rank,
        "learning_rate": options.lr,
        "batch_size": options.batch_size,
        "seed": options.seed,
    }


def _batch(train: list[Example], options: TrainOptions, step: int) -> list[Example]:
    """The step's examples: a function of the step alone (resumable), each pass over the
    training examples in a fresh seeded order."""
    picks = []
    for drawn in range(step * options.batch_size, (step + 1) * options.batch_size):
        epoch, offset = divmod(drawn, len(train))
        order = list(range(len(train)))
        random.Random(f"{options.seed}/{epoch}").shuffle(order)
        picks.append(train[order[offset]])
    return picks


def _verdict_logits(tuned: TunedHeads, examples: list[Example], verdict) -> torch.Tensor:
    """z[A] − z[B] at the last position of each example, [B]."""
    lengths = [len(e.hidden) for e in examples]
    hidden = torch.cat([e.hidden for e in examples])[None]  # [1, N, D]
    logits = tuned.head_stack().forward_training(hidden, lengths, last_only=True)[0]  # [B, V]
    return verdict_logit(logits, verdict)


def _loss(tuned: TunedHeads, batch: list[Example], verdict) -> torch.Tensor:
    labels = torch.tensor([float(e.correct) for e in batch])
    return F.binary_cross_entropy_with_logits(_verdict_logits(tuned, batch, verdict), labels)


def calibration(tuned: TunedHeads, examples: list[Example], verdict) -> Calibration:
    with torch.no_grad():
        p = torch.sigmoid(_verdict_logits(tuned, examples, verdict))
    labels = torch.tensor([float(e.correct) for e in examples])
    return Calibration(
        brier=float(((p - labels) ** 2).mean()),
        accuracy=float(((p > 0.5).float() == labels).float().mean()),
        mean_p=float(p.mean()),
    )
