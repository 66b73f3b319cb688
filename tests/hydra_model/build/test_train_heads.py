"""`train-heads`: each head fine-tuned on its own shard, full or LoRA (merged on save),
resumable, written as a checkpoint the runtime loads; its bad inputs."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hydra_jury.cli import main
from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.corpus import CorpusError, shard_texts, write_corpus
from hydra_jury.hydra_model.build.lora import lora_deltas
from hydra_jury.hydra_model.build.train import (
    ADAPTERS_DIR,
    TrainError,
    TrainOptions,
    train_heads,
)
from hydra_jury.hydra_model.build.train_state import state_dir
from tests.models import next_token_logits

PHRASES = ["the cat sat", "a dog ran", "sun is up", "we go home", "red box", "big tree"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    texts = [" ".join(rng.choice(PHRASES) for _ in range(10)) for _ in range(40)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_corpus(path, texts)
    return path


def options(checkpoint, corpus, out, **changes) -> TrainOptions:
    values = dict(steps=12, seq_len=32, batch_size=2, save_every=4)
    return TrainOptions(str(checkpoint), str(corpus), str(out), **{**values, **changes})


def head_tensors(checkpoint, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "heads" / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def trained(jury_checkpoint, corpus, tmp_path_factory):
    """A full fine-tune of every head of the jury checkpoint."""
    out = tmp_path_factory.mktemp("trained") / "full"
    return out, train_heads(options(jury_checkpoint, corpus, out), log=lambda line: None)


@pytest.mark.numerics
def test_full_training_lowers_every_heads_loss_and_writes_a_checkpoint(jury_checkpoint, trained):
    out, result = trained
    assert result.heads == ["head0", "head1", "head2", "head3"]
    first, last = torch.tensor(result.losses[0]), torch.tensor(result.losses[-1])
    assert (last < first - 0.5).all(), (first, last)
    assert not state_dir(out).exists()
    # The trunk and tokenizer are the base's, byte for byte; every head changed.
    assert (out / "trunk.safetensors").read_bytes() == (
        jury_checkpoint / "trunk.safetensors"
    ).read_bytes()
    for name in result.heads:
        before, after = head_tensors(jury_checkpoint, name), head_tensors(out, name)
        assert before.keys() == after.keys()
        assert not torch.equal(before["layers.2.q_proj.weight"], after["layers.2.q_proj.weight"])
        # The LM head is never trained.
        if "lm_head.weight" in before:
            assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    manifest = json.loads((out / "hydra.json").read_text())
    record = manifest["training"]
    assert record["method"] == "full" and record["steps"] == 12
    assert manifest["heads"][0]["source"].startswith("train-heads: shard 0")


@pytest.mark.numerics
def test_each_head_learns_its_own_shard(jury_checkpoint, corpus, trained):
    """The text each head trained on is likelier under it than under the base head."""
    out, _ = trained
    base, tuned = HydraModel.load(jury_checkpoint), HydraModel.load(out)
    tokenizer = base.load_tokenizer()
    text = json.loads(corpus.read_text().splitlines()[0])["text"]
    tokens = tokenizer.encode(text, add_special_tokens=False)[:20]
    # Shard 0 holds text 0: head 0 predicts its tokens better after training.
    gains = []
    for cut in range(4, len(tokens)):
        before = torch.log_softmax(next_token_logits(base, tokens[:cut]), -1)[0, tokens[cut]]
        after = torch.log_softmax(next_token_logits(tuned, tokens[:cut]), -1)[0, tokens[cut]]
        gains.append(float(after - before))
    assert sum(gains) / len(gains) > 0.3


@pytest.mark.numerics
def test_lora_training_saves_adapters_and_merges_them(jury_checkpoint, corpus, tmp_path):
    out = tmp_path / "lora"
    result = train_heads(options(jury_checkpoint, corpus, out, lora_rank=4), log=lambda line: None)
    assert (torch.tensor(result.losses[-1]) < torch.tensor(result.losses[0])).all()
    manifest = json.loads((out / "hydra.json").read_text())
    assert manifest["training"]["method"] == "lora" and manifest["training"]["lora_rank"] == 4
    for name in result.heads:
        adapter = out / ADAPTERS_DIR / name
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == 4 and "q_proj" in config["target_modules"]
        # The stored head is the base head with its adapter merged by the builder's code.
        base, merged = head_tensors(jury_checkpoint, name), head_tensors(out, name)
        deltas = lora_deltas(adapter, trunk_layers=2, num_layers=4)
        assert set(deltas) == {
            f"layers.{layer}.{module}.weight"
            for layer in (2, 3)
            for module in (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            )
        }
        for weight, delta in deltas.items():
            assert delta.abs().max() > 0
            torch.testing.assert_close(merged[weight], base[weight] + delta, rtol=0, atol=1e-6)
        # Norms stay frozen under LoRA.
        assert torch.equal(merged["norm.weight"], base["norm.weight"])
    # The merged checkpoint loads and runs.
    logits = next_token_logits(HydraModel.load(out), [5, 6, 7])
    assert torch.isfinite(logits).all()


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(jury_checkpoint, corpus, tmp_path):
    whole = tmp_path / "whole"
    train_heads(options(jury_checkpoint, corpus, whole, lora_rank=2), log=lambda line: None)

    class Interrupted(Exception):
        pass

    def stop_after_six(step, steps, losses):
        if step == 6:
            raise Interrupted

    resumed = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        train_heads(
            options(jury_checkpoint, corpus, resumed, lora_rank=2),
            log=lambda line: None,
            on_step=stop_after_six,
        )
    # Saved at step 4 (every 4 steps): the run goes on from there.
    logged = []
    result = train_heads(options(jury_checkpoint, corpus, resumed, lora_rank=2), log=logged.append)
    assert result.resumed_at == 4 and "resuming at step 4 of 12" in logged[0]
    for name in result.heads:
        expected, got = head_tensors(whole, name), head_tensors(resumed, name)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6)


def test_a_resumed_run_must_keep_its_settings(jury_checkpoint, corpus, tmp_path):
    out = tmp_path / "run"

    def stop(step, steps, losses):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(options(jury_checkpoint, corpus, out), log=lambda line: None, on_step=stop)
    with pytest.raises(TrainError, match="other settings \\(learning_rate\\)"):
        train_heads(options(jury_checkpoint, corpus, out, learning_rate=0.5), log=print)
    # --force starts over.
    result = train_heads(
        options(jury_checkpoint, corpus, out, steps=2, force=True), log=lambda line: None
    )
    assert result.resumed_at == 0 and len(result.losses) == 2


def test_shards_are_round_robin():
    assert shard_texts(list("abcdefg"), 3) == [["a", "d", "g"], ["b", "e"], ["c", "f"]]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "holds no texts"),
        (["not json"], "corpus.jsonl:1: not valid JSON"),
        (
            ['{"text": "a b"}', '{"txt": "x"}'],
            'corpus.jsonl:2: expected an object with a string field "text"',
        ),
        (['{"text": "a b"}'], "1 texts for 4 heads"),
        (['{"text": "ab"}'] * 4, "holds fewer than --seq-len 32 tokens"),
    ],
)
def test_bad_corpora_are_refused_with_the_line(jury_checkpoint, tmp_path, lines, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=message):
        train_heads(options(jury_checkpoint, corpus, tmp_path / "out"), log=lambda line: None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(steps=0), "--steps must be at least 1"),
        (dict(seq_len=1), "--seq-len must be at least 2"),
        (dict(seq_len=100_000), "exceeds the model's context length"),
        (dict(lora_rank=0), "--lora 0: the rank must be between 1 and"),
        (dict(learning_rate=-1.0), "--lr must be a positive number"),
    ],
)
def test_bad_arguments_are_refused(jury_checkpoint, corpus, tmp_path, changes, message):
    with pytest.raises(TrainError, match=message):
        train_heads(options(jury_checkpoint, corpus, tmp_path / "out", **changes), log=print)
    assert not (tmp_path / "out").exists()


def test_the_command_line(jury_checkpoint, corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train-heads", "--checkpoint", str(jury_checkpoint), "--data", str(corpus)]
    argv += ["--out", str(out), "--steps", "3", "--seq-len", "32", "--lora", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "head3: loss" in printed.out and "at step 3" in printed.out
    assert "train-heads" in printed.err  # the progress bar
    # A finished --out is never overwritten silently.
    assert main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    # --replace-stale replaces what it cannot resume, and says why.
    assert main([*argv, "--replace-stale"]) == 0
    assert f"{out}: starting over ({out} already exists" in capsys.readouterr().err
    shutil.rmtree(out)
    assert main([*argv[:-2], "--lora", "99999"]) == 2
    assert "the rank must be between 1 and" in capsys.readouterr().err
    missing = ["train-heads", "--checkpoint", str(tmp_path / "nope"), "--data", str(corpus)]
    assert main([*missing, "--out", str(out)]) == 2
    assert "hydra-jury train-heads: error:" in capsys.readouterr().err
