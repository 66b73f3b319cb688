"""`train-heads --uncertainty`: the multiple-choice set, grading, training the uncertainty
head and its calibration on held-out questions, on a tiny model."""

from __future__ import annotations

import json

import pytest

from hydra_jury.cli import main
from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build import multiple_choice
from hydra_jury.hydra_model.build.multiple_choice import Question, grade, make_questions
from hydra_jury.hydra_model.build.train import TrainError, TrainOptions
from hydra_jury.hydra_model.build.train_uncertainty import train_uncertainty
from tests.models import build_hydra, save_hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint whose tokenizer has the letters A-D, with an uncertainty head."""
    root = tmp_path_factory.mktemp("uncertainty")
    base = save_hf_model(root / "base", "llama", seed=4, vocab_size=40, logit_scale=10.0)
    return build_hydra(base, root / "hydra", trunk_layers=2, heads=3, uncertainty_head=True)


def options(checkpoint, out, **changes) -> TrainOptions:
    values = dict(steps=40, batch_size=8, learning_rate=3e-3, questions=48, save_every=10)
    return TrainOptions(str(checkpoint), "", str(out), **{**values, **changes})


def test_questions_are_seeded_and_checkable():
    questions = make_questions(50, seed=1)
    assert questions == make_questions(50, seed=1) != make_questions(50, seed=2)
    assert {q.correct for q in questions} == set("ABCD")
    sums = [q for q in questions if q.text.startswith("What is ") and " + " in q.text]
    a, b = (int(x) for x in sums[0].text.split("?")[0][len("What is ") :].split(" + "))
    assert f"{sums[0].correct}) {a + b}\n" in sums[0].text


def test_grading():
    question = Question("What is 1 + 1?\nA) 3\nB) 2\nC) 0\nD) 12\nReply.", "B")
    assert grade(question, "B")
    assert grade(question, " B) 2")
    assert grade(question, "(B")
    assert not grade(question, "A")
    assert not grade(question, "Because")  # not a letter on its own
    assert grade(question, "the answer is 2")  # no letter: the right option's text
    assert not grade(question, "the answer is 3")
    assert not grade(question, "1 + 1 = 12")  # the right option's text, but as a word


@pytest.mark.numerics
def test_training_calibrates_the_head_on_held_out_questions(checkpoint, tmp_path, monkeypatch):
    """The tiny model's answers are noise, so the grades are made learnable: sums and
    differences count as answered right, the rest wrong. The trained head must tell them
    apart on questions it never saw."""

    def by_kind(question, answer):
        return question.text.startswith("What is")

    monkeypatch.setattr(multiple_choice, "grade", by_kind)
    out = tmp_path / "judged"
    result = train_uncertainty(options(checkpoint, out), log=lambda line: None)
    assert result.before.accuracy < 0.8 and result.before.brier > 0.15
    assert result.after.accuracy >= 0.9
    assert result.after.brier < 0.1 < result.constant_brier
    record = json.loads((out / "hydra.json").read_text())["uncertainty_training"]
    assert record["questions"] == 48 and record["held_out"] == 12
    assert record["held_out_after"]["brier"] == pytest.approx(result.after.brier)
    # Only the uncertainty head changed.
    for name in ("trunk.safetensors", "heads/head0.safetensors"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes()
    assert (out / "heads/uncertainty.safetensors").read_bytes() != (
        checkpoint / "heads/uncertainty.safetensors"
    ).read_bytes()
    assert HydraModel.load(out, role="uncertainty").head_names == ["uncertainty"]


def test_the_models_own_grades(checkpoint, tmp_path):
    examples = multiple_choice.answer_and_grade(HydraModel.load(checkpoint), make_questions(8, 0))
    assert len(examples) == 8
    for example in examples:
        assert example.correct == grade(example.question, example.answer)
        assert example.hidden.shape[1] == 64 and not example.hidden.is_inference()


def test_a_checkpoint_without_an_uncertainty_head_is_refused(jury_checkpoint, tmp_path):
    with pytest.raises(TrainError, match="has no uncertainty head: build the checkpoint with"):
        train_uncertainty(options(jury_checkpoint, tmp_path / "out"), log=print)
    with pytest.raises(TrainError, match="--questions must be at least 8"):
        train_uncertainty(options(jury_checkpoint, tmp_path / "out", questions=2), log=print)


def test_the_command_line(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train-heads", "--checkpoint", str(checkpoint), "--out", str(out)]
    assert main([*argv, "--uncertainty", "--questions", "16", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "trained head:   Brier" in printed and "untrained head: Brier" in printed
    assert main([*argv, "--uncertainty", "--data", "corpus.jsonl"]) == 2
    assert "give --data" in capsys.readouterr().err
    assert main(argv) == 2
    assert "give --data" in capsys.readouterr().err


def test_an_interrupted_run_resumes_without_answering_again(checkpoint, tmp_path, monkeypatch):
    """The graded answers are kept with the run's state: the resumed run reads them back
    and ends bit for bit where an uninterrupted run ends."""
    settings = dict(steps=4, questions=16, save_every=2)
    whole = tmp_path / "whole"
    train_uncertainty(options(checkpoint, whole, **settings), log=lambda line: None)

    class Interrupted(Exception):
        pass

    def stop_at_3(step, steps, losses):
        if step == 3:
            raise Interrupted

    out = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        train_uncertainty(options(checkpoint, out, **settings), lambda line: None, stop_at_3)

    def unanswerable(model, questions):
        raise AssertionError("the resumed run answered the questions again")

    monkeypatch.setattr(
        "hydra_jury.hydra_model.build.train_uncertainty.answer_and_grade", unanswerable
    )
    lines: list[str] = []
    result = train_uncertainty(options(checkpoint, out, **settings), log=lines.append)
    assert f"{out}: the 16 graded answers of the interrupted run" in lines
    assert f"{out}: resuming at step 2 of 4" in lines and result.resumed_at == 2
    head = "heads/uncertainty.safetensors"
    assert (out / head).read_bytes() == (whole / head).read_bytes()
    saved, expected = (json.loads((d / "hydra.json").read_text()) for d in (out, whole))
    assert saved["uncertainty_training"] == expected["uncertainty_training"]
