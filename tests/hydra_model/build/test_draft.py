"""Draft model sources: a Hugging Face directory is converted once into the cache and
reused until it changes; a Hydra checkpoint is used as it is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.builder import BuildError
from hydra_jury.hydra_model.build.draft import default_draft_cache, resolve_draft_model
from tests.models import build_hydra, load_hf_model, next_token_logits, save_hf_model

TOLERANCE = 1e-4
TOKENS = [1, 7, 12, 30, 5, 9]


def expected_logits(source: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(source)(torch.tensor([TOKENS])).logits[0, -1].double()


def resolve(source: Path | str, cache: Path) -> tuple[Path, list[str]]:
    lines: list[str] = []
    return resolve_draft_model(source, cache, log=lines.append), lines


def test_hf_directory_is_converted_once_and_reused(tmp_path):
    source = save_hf_model(tmp_path / "small", "llama", seed=3)
    cache = tmp_path / "cache"
    first, lines = resolve(source, cache)
    assert first.parent == cache and first.name.startswith("small-")
    assert lines == [f"draft model {source}: converting into {first} (once)"]
    model = HydraModel.load(first)
    assert model.manifest.trunk_layers == 3 and model.head_names == ["head0"]
    assert model.manifest.dtype == "float32"
    # The trunk and its one head in a row are the whole source model.
    got = next_token_logits(model, TOKENS)[0]
    assert (got - expected_logits(source)).abs().max() <= TOLERANCE

    built_at = (first / "hydra.json").stat().st_mtime_ns
    again, lines = resolve(str(source), cache)
    assert again == first and lines == [f"draft model {source}: reusing {first}"]
    assert (first / "hydra.json").stat().st_mtime_ns == built_at


def test_changed_source_is_rebuilt(tmp_path):
    source = save_hf_model(tmp_path / "small", "llama", seed=3)
    cache = tmp_path / "cache"
    first, _ = resolve(source, cache)
    save_hf_model(source, "llama", seed=4)  # same file names and sizes, new weights
    # Whatever the file system's clock resolution, the rewrite must look newer.
    for file in source.iterdir():
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    second, lines = resolve(source, cache)
    assert second != first and lines[0].endswith("(once)")
    got = next_token_logits(HydraModel.load(second), TOKENS)[0]
    assert (got - expected_logits(source)).abs().max() <= TOLERANCE


def test_broken_conversion_is_rebuilt(tmp_path):
    source = save_hf_model(tmp_path / "small", "llama", seed=3)
    cache = tmp_path / "cache"
    first, _ = resolve(source, cache)
    (first / "trunk.safetensors").unlink()
    again, lines = resolve(source, cache)
    assert again == first and lines[0].endswith("(once)")
    HydraModel.load(again)


def test_hydra_checkpoint_is_used_as_it_is(tmp_path):
    source = save_hf_model(tmp_path / "small", "llama", seed=3)
    checkpoint = build_hydra(source, tmp_path / "hydra", heads=2)
    got, lines = resolve(checkpoint, tmp_path / "cache")
    assert got == checkpoint and lines == []
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "nowhere", "nowhere: no such file or directory"),
        (
            lambda root: _write(root / "weights.bin", "x"),
            "weights.bin: not a Hydra checkpoint, a Hugging Face model directory or a .gguf",
        ),
        (lambda root: _write(root / "empty" / "README", "x").parent, "config.json: missing"),
        (
            lambda root: _write(root / "bad" / "hydra.json", "{").parent,
            "draft model: .*hydra.json: not valid JSON",
        ),
    ],
    ids=["missing", "other-file", "no-config", "broken-checkpoint"],
)
def test_unusable_sources(tmp_path, make, message):
    with pytest.raises(BuildError, match=message):
        resolve(make(tmp_path), tmp_path / "cache")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_default_draft_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRA_JURY_CACHE", str(tmp_path / "jury"))
    assert default_draft_cache() == tmp_path / "jury" / "draft-models"
    monkeypatch.delenv("HYDRA_JURY_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_draft_cache() == tmp_path / "home" / ".cache" / "hydra-jury" / "draft-models"
