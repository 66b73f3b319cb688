"""Every way a checkpoint can be broken gives a message naming the file and the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hydra_jury.hydra_model import CheckpointError, HydraModel
from tests.models import build_hydra, edit_manifest, save_hf_model


@pytest.fixture
def checkpoint(hydra_checkpoints, tmp_path):
    return shutil.copytree(hydra_checkpoints["llama"], tmp_path / "ckpt")


def test_missing_manifest(checkpoint):
    (checkpoint / "hydra.json").unlink()
    with pytest.raises(CheckpointError, match=r"hydra.json: missing; .* is not a Hydra"):
        HydraModel.load(checkpoint)


@pytest.mark.parametrize("name", ["trunk.safetensors", "heads/head1.safetensors", "tokenizer.json"])
def test_missing_file(checkpoint, name):
    (checkpoint / name).unlink()
    with pytest.raises(CheckpointError, match=rf"{name}: missing file of the Hydra checkpoint"):
        HydraModel.load(checkpoint)


def test_wrong_shape(checkpoint):
    path = checkpoint / "trunk.safetensors"
    tensors = load_file(str(path))
    tensors["layers.1.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(path))
    with pytest.raises(
        CheckpointError,
        match=r"trunk.safetensors: tensor layers.1.k_proj.weight "
        r"has shape \(16, 64\), expected \(32, 64\)",
    ):
        HydraModel.load(checkpoint)


def test_missing_tensor(checkpoint):
    path = checkpoint / "heads" / "head0.safetensors"
    tensors = load_file(str(path))
    del tensors["norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"head0.safetensors: missing tensors \['norm"):
        HydraModel.load(checkpoint)


def test_unknown_architecture(checkpoint):
    data = json.loads((checkpoint / "hydra.json").read_text())
    data["decoder"]["family"] = "gpt2"
    edit_manifest(checkpoint, decoder=data["decoder"])
    with pytest.raises(CheckpointError, match=r"hydra.json: unknown decoder family 'gpt2'"):
        HydraModel.load(checkpoint)


@pytest.mark.parametrize("trunk_layers", [0, 4, 9, "2"])
def test_trunk_layers_out_of_range(checkpoint, trunk_layers):
    edit_manifest(checkpoint, trunk_layers=trunk_layers)
    with pytest.raises(
        CheckpointError,
        match=r"hydra.json: trunk_layers=.* is out of range; "
        r"it must be between 1 and 3",
    ):
        HydraModel.load(checkpoint)


def test_heads_of_different_shapes(checkpoint, tmp_path):
    other = save_hf_model(tmp_path / "wide", "llama", intermediate_size=128)
    wide = build_hydra(other, tmp_path / "wide-hydra", heads=1)
    shutil.copy(wide / "heads" / "head0.safetensors", checkpoint / "heads" / "head1.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"heads/head1.safetensors: tensor layers.2.gate_proj.weight has "
        r"shape \(128, 64\), expected \(96, 64\) .*every head must have "
        r"the same shapes",
    ):
        HydraModel.load(checkpoint)


def test_unsupported_format_version(checkpoint):
    edit_manifest(checkpoint, format_version=99)
    with pytest.raises(CheckpointError, match=r"unsupported format_version 99"):
        HydraModel.load(checkpoint)


def test_corrupt_safetensors(checkpoint):
    (checkpoint / "trunk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"trunk.safetensors: cannot be read"):
        HydraModel.load(checkpoint)


def test_bad_head_entries(checkpoint):
    data = json.loads((checkpoint / "hydra.json").read_text())
    heads = data["heads"]
    edit_manifest(checkpoint, heads=[{**heads[0], "role": "critic"}])
    with pytest.raises(CheckpointError, match="unknown role 'critic'"):
        HydraModel.load(checkpoint)
    edit_manifest(checkpoint, heads=[heads[0], heads[0]])
    with pytest.raises(CheckpointError, match="duplicate head names"):
        HydraModel.load(checkpoint)
    edit_manifest(checkpoint, heads=heads)
    with pytest.raises(CheckpointError, match=r"unknown heads \['head9'\]"):
        HydraModel.load(checkpoint, heads=["head9"])
