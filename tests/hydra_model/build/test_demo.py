"""The demo draft model: built once per layer count (the logic on a tiny source standing in
for the GGUF file), and the real SmolLM2 one is `transformers`' model cut to its first
layers."""

from __future__ import annotations

import os
import shutil

import pytest

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build import demo
from hydra_jury.hydra_model.build.demo import ensure_demo_draft
from hydra_jury.hydra_model.checkpoint import training_summary
from tests.models import save_hf_model


@pytest.fixture
def tiny_demo(monkeypatch, tmp_path):
    """A 4-layer Hugging Face directory in place of the SmolLM2 GGUF file."""
    source = save_hf_model(tmp_path / "source", "llama", seed=8)
    monkeypatch.setattr(demo, "demo_gguf_path", lambda: source)
    return source


def test_draft_is_built_once_per_layer_count(tiny_demo, tmp_path):
    out = tmp_path / "draft"
    lines: list[str] = []
    ensure_demo_draft(out, layers=3, log=lines.append)
    model = HydraModel.load(out)
    assert model.config.num_layers == 3 and model.manifest.trunk_layers == 2
    assert model.head_names == ["head0"]

    built_at = (out / "hydra.json").stat().st_mtime_ns
    lines.clear()
    ensure_demo_draft(out, layers=3, log=lines.append)
    assert lines == [f"{out}: demo draft model already built"]
    assert (out / "hydra.json").stat().st_mtime_ns == built_at

    lines.clear()
    ensure_demo_draft(out, layers=2, log=lines.append)
    assert lines[0] == f"{out}: rebuilding (it has 3 layers and heads ['llm'])"
    assert HydraModel.load(out).config.num_layers == 2

    (out / "trunk.safetensors").unlink()
    lines.clear()
    ensure_demo_draft(out, layers=2, log=lines.append)
    assert lines[0].startswith(f"{out}: rebuilding (") and "trunk.safetensors" in lines[0]
    HydraModel.load(out)


def test_demo_checkpoint_trains_its_heads_once(tiny_demo, tmp_path, monkeypatch):
    """The split, the corpus the base model writes, train-heads and train-heads
    --uncertainty, each kept for the next build (tiny settings)."""
    monkeypatch.setattr(demo, "TRUNK_LAYERS", 2)
    monkeypatch.setattr(demo, "CORPUS_TOKENS", 24)
    monkeypatch.setattr(demo, "TRAINING", dict(steps=2, batch_size=2, seq_len=32))
    monkeypatch.setattr(demo, "UNCERTAINTY_TRAINING", dict(steps=2, batch_size=4, questions=8))
    base, corpus, out = tmp_path / "base", tmp_path / "corpus.jsonl", tmp_path / "demo"
    lines: list[str] = []
    demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)
    manifest = HydraModel.load(out).manifest
    assert {"training", "uncertainty_training"} <= set(manifest.extra)
    assert [h.role for h in manifest.heads] == ["llm"] * 4 + ["uncertainty"]
    assert manifest.heads[0].source.startswith("train-heads: shard 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "corpus.jsonl", "demo", "source"]
    assert len(corpus.read_text().splitlines()) == len(demo.demo_prompts())

    lines.clear()
    demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)
    assert lines == [f"{out}: demo checkpoint already built"]
    # Without the checkpoint, the split and the corpus are reused.
    shutil.rmtree(out)
    lines.clear()
    demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)
    assert f"{base}: demo split already built" in lines
    assert f"{corpus}: demo corpus already written" in lines


@pytest.fixture
def tiny_settings(monkeypatch):
    """The demo's build on the tiny source: a 2-layer trunk, a state saved every step."""
    monkeypatch.setattr(demo, "TRUNK_LAYERS", 2)
    monkeypatch.setattr(demo, "CORPUS_TOKENS", 24)
    monkeypatch.setattr(demo, "TRAINING", dict(steps=3, batch_size=2, seq_len=32, save_every=1))
    monkeypatch.setattr(
        demo, "UNCERTAINTY_TRAINING", dict(steps=3, batch_size=4, questions=8, save_every=1)
    )


class Interrupted(Exception):
    pass


def interrupt_at(step: int, steps: int):
    """A progress callback class that stops the first run of `steps` steps after `step`,
    as Ctrl-C would."""
    runs: list[int] = []

    class Bar:
        def __call__(self, done: int, total: int, losses: list[float]) -> None:
            if done == step and total == steps and not runs:
                runs.append(done)
                raise Interrupted

    return Bar


def test_interrupted_build_resumes_where_it_stopped(
    tiny_demo, tiny_settings, tmp_path, monkeypatch
):
    base, corpus, out = tmp_path / "base", tmp_path / "corpus.jsonl", tmp_path / "demo"
    lines: list[str] = []

    def build() -> None:
        demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)

    heads = tmp_path / ".demo.llm-heads"

    monkeypatch.setattr(demo, "ProgressBar", interrupt_at(2, 3))
    with pytest.raises(Interrupted):
        build()  # stopped in train-heads, after its second step was saved
    assert not out.exists() and (heads / ".train").is_dir()
    lines.clear()
    build()
    assert f"{heads}: resuming at step 2 of 3" in lines
    assert f"{base}: demo split already built" in lines
    assert f"{corpus}: demo corpus already written" in lines

    shutil.rmtree(out)
    shutil.copytree(tmp_path / "base", heads, dirs_exist_ok=True)  # not the trained heads
    lines.clear()
    build()
    assert any(line.startswith(f"{heads}: starting over (") for line in lines)


def test_interrupted_uncertainty_training_keeps_the_trained_heads(
    tiny_demo, tiny_settings, tmp_path, monkeypatch
):
    base, corpus, out = tmp_path / "base", tmp_path / "corpus.jsonl", tmp_path / "demo"
    lines: list[str] = []
    monkeypatch.setattr(demo, "ProgressBar", interrupt_at(1, 3))
    # train-heads' 3 steps pass; the uncertainty head's first step interrupts.
    monkeypatch.setattr(demo, "TRAINING", dict(steps=2, batch_size=2, seq_len=32))
    with pytest.raises(Interrupted):
        demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)
    assert (out / ".train").is_dir() and not (out / "hydra.json").exists()
    lines.clear()
    demo.ensure_demo_checkpoint(out, lines.append, base=base, corpus=corpus)
    heads = tmp_path / ".demo.llm-heads"
    assert f"{heads}: heads already trained" in lines
    assert f"{out}: the 8 graded answers of the interrupted run" in lines
    assert f"{out}: resuming at step 1 of 3" in lines
    assert demo.is_trained_demo(out) and not heads.exists()


def test_servable_is_the_trained_demo_or_else_the_untrained_split(
    tiny_demo, tiny_settings, tmp_path, capsys
):
    base, out = tmp_path / "base", tmp_path / "demo"
    args = ["--servable", "--out", str(out), "--base", str(base)]
    assert demo.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{base}\n"
    assert f"serving the untrained split {base}" in captured.err
    assert "`make model` trains them" in captured.err
    assert [h.role for h in HydraModel.load(base).manifest.heads] == ["llm"] * 4 + ["uncertainty"]
    assert training_summary(base) == "heads untrained"

    demo.ensure_demo_checkpoint(out, lambda line: None, base=base, corpus=tmp_path / "c.jsonl")
    assert demo.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{out}\n"
    assert f"serving the trained demo checkpoint {out}" in captured.err
    assert training_summary(out) == "heads trained, uncertainty head trained"
    with pytest.raises(SystemExit):
        demo.main(["--servable", "--draft"])
    assert "--servable chooses the demo checkpoint" in capsys.readouterr().err


def test_main_draft_flags(tiny_demo, tmp_path, capsys):
    out = tmp_path / "draft"
    assert demo.main(["--draft", "--layers", "3", "--out", str(out)]) == 0
    assert HydraModel.load(out).config.num_layers == 3
    assert demo.main(["--draft", "--layers", "9", "--out", str(out)]) == 2
    assert "error: --layers 9 is out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--layers", "3"])
    assert "--layers only applies to the draft model: add --draft" in capsys.readouterr().err


def test_a_gguf_load_reads_the_file_once_and_puts_the_gguf_package_back(tmp_path):
    import gguf

    from hydra_jury.hydra_model.build.sources import _gguf_read_once

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("tiny.value", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
    # The next read of the same file, unchanged, gets the same reader (a build reads
    # its GGUF for the model, then for the tokenizer); a changed file is read again.
    with _gguf_read_once():
        first = gguf.GGUFReader(path)
    with _gguf_read_once():
        assert gguf.GGUFReader(path) is first
    os.utime(path, ns=(0, 0))
    with _gguf_read_once():
        assert gguf.GGUFReader(path) is not first
