"""Building checkpoints: heads from fine-tunes and LoRA adapters, the uncertainty head,
early-exit checkpoints (`--layers`), overwrite protection, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from hydra_jury.cli import main
from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.builder import BuildError
from tests.models import build_hydra, fine_tune_top_layers, load_hf_model, save_hf_model

TOLERANCE = 1e-4
TRUNK_LAYERS = 2


def head_logits(model: HydraModel, head: int, tokens: torch.Tensor) -> torch.Tensor:
    hidden = model.trunk.forward(tokens, model.trunk_cache(64), 0)
    return model.heads.select(head).forward(hidden, model.head_cache(1, 64), 0)[0]


def reference(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def build(base, tmp_path, **options):
    """`base` built into `tmp_path / "hydra"` over a trunk of `TRUNK_LAYERS` layers."""
    return build_hydra(base, tmp_path / "hydra", trunk_layers=TRUNK_LAYERS, **options)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_hf_model(
        tmp_path_factory.mktemp("base") / "model", "llama", seed=5, tie_word_embeddings=True
    )


def test_head_from_reproduces_the_fine_tune(base, tmp_path):
    tuned = fine_tune_top_layers(base, tmp_path / "tuned", TRUNK_LAYERS, seed=11)
    out = build(base, tmp_path, heads=2, head_from=[str(tmp_path / "tuned")])
    model = HydraModel.load(out)
    tokens = torch.arange(30) % 40
    assert (head_logits(model, 0, tokens) - reference(tuned, tokens)).abs().max() <= TOLERANCE
    base_logits = reference(load_hf_model(base), tokens)
    assert (head_logits(model, 1, tokens) - base_logits).abs().max() <= TOLERANCE
    manifest = json.loads((out / "hydra.json").read_text())
    assert [h["lm_head"] for h in manifest["heads"]] == ["embedding", "embedding"]
    assert manifest["heads"][0]["source"].startswith("from ")


def make_lora_adapter(base, out, layers: list[int]):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        layers_to_transform=layers,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(load_hf_model(base), config)
    peft_model.save_pretrained(str(out))
    return peft_model.merge_and_unload().eval()


def test_lora_head_reproduces_the_merged_adapter(base, tmp_path):
    merged = make_lora_adapter(base, tmp_path / "adapter", layers=[2, 3])
    out = build(base, tmp_path, heads=2, lora=[str(tmp_path / "adapter")])
    model = HydraModel.load(out)
    tokens = torch.arange(25) % 40
    expected = reference(merged, tokens)
    assert (head_logits(model, 0, tokens) - expected).abs().max() <= TOLERANCE
    assert (head_logits(model, 1, tokens) - expected).abs().max() > 1e-3  # a plain copy


def test_lora_on_trunk_layers_is_refused(base, tmp_path):
    make_lora_adapter(base, tmp_path / "adapter", layers=[1, 2])
    with pytest.raises(BuildError, match="adapts layer 1, which is in the shared trunk"):
        build(base, tmp_path, heads=1, lora=[str(tmp_path / "adapter")])
    assert not (tmp_path / "hydra").exists()  # nothing half-written is left behind


def test_uncertainty_head_and_dtype(base, tmp_path):
    out = build_hydra(base, tmp_path / "hydra", heads=2, uncertainty_head=True, dtype="bfloat16")
    manifest = json.loads((out / "hydra.json").read_text())
    assert [(h["name"], h["role"]) for h in manifest["heads"]] == [
        ("head0", "llm"),
        ("head1", "llm"),
        ("uncertainty", "uncertainty"),
    ]
    assert HydraModel.load(out).head_names == ["head0", "head1"]
    uncertainty = HydraModel.load(out, role="uncertainty", load_trunk=False)
    assert uncertainty.head_names == ["uncertainty"] and uncertainty.trunk is None
    assert uncertainty.heads.norm.dtype == torch.bfloat16


def test_refuses_to_overwrite_without_force(base, tmp_path):
    out = build_hydra(base, tmp_path / "hydra", heads=1)
    with pytest.raises(BuildError, match="already exists; pass --force"):
        build_hydra(base, out, heads=2)
    build_hydra(base, out, heads=2, force=True)
    assert HydraModel.load(out).head_names == ["head0", "head1"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"trunk_layers": 4}, "--trunk-layers 4 is out of range"),
        ({"trunk_layers": 0}, "--trunk-layers 0 is out of range"),
        ({"heads": 0}, "--heads must be at least 1"),
        ({"heads": 1, "lora": ["a", "b"]}, "only --heads 1"),
        ({"dtype": "int8"}, "--dtype 'int8'"),
        (
            {"layers": 1},
            r"--layers 1 is out of range: the model has 4 layers, so it must be 2\.\.4",
        ),
        (
            {"layers": 5},
            r"--layers 5 is out of range: the model has 4 layers, so it must be 2\.\.4",
        ),
        (
            {"layers": 3, "trunk_layers": 3},
            r"--trunk-layers 3 is out of range: --layers keeps 3 layers, so it must be 1\.\.2",
        ),
    ],
)
def test_bad_build_options(base, tmp_path, options, message):
    with pytest.raises(BuildError, match=message):
        build_hydra(base, tmp_path / "hydra", **options)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "olmo2"])
@pytest.mark.parametrize(("layers", "trunk_layers"), [(2, 1), (3, 2), (3, 1)])
def test_layers_keeps_the_first_layers(source_models, tmp_path, variant, layers, trunk_layers):
    from transformers import AutoModelForCausalLM

    source = source_models[variant]
    out = build_hydra(source, tmp_path / "hydra", trunk_layers=trunk_layers, heads=2, layers=layers)
    model = HydraModel.load(out)
    assert model.config.num_layers == layers
    assert model.manifest.trunk_layers == trunk_layers
    assert model.manifest.source == f"{source} (first {layers} of 4 layers)"
    # transformers' own early exit: the first layers, then the final norm and LM head.
    truncated = AutoModelForCausalLM.from_pretrained(
        str(source), num_hidden_layers=layers, dtype=torch.float32
    ).eval()
    assert len(truncated.model.layers) == layers
    tokens = torch.arange(30) % 40
    expected = reference(truncated, tokens)
    assert (reference(load_hf_model(source), tokens) - expected).abs().max() > 1e-2
    for head in range(2):
        assert (head_logits(model, head, tokens) - expected).abs().max() <= TOLERANCE


def test_layers_equal_to_the_source_changes_nothing(base, tmp_path):
    out = build_hydra(base, tmp_path / "hydra", heads=1, layers=4)
    model = HydraModel.load(out)
    assert model.config.num_layers == 4 and model.manifest.source == str(base)
    tokens = torch.arange(20) % 40
    expected = reference(load_hf_model(base), tokens)
    assert (head_logits(model, 0, tokens) - expected).abs().max() <= TOLERANCE


def test_head_from_other_architecture_is_refused(base, tmp_path):
    other = save_hf_model(tmp_path / "other", "llama", intermediate_size=64)
    with pytest.raises(BuildError, match="architecture differs"):
        build_hydra(base, tmp_path / "hydra", heads=1, head_from=[str(other)])


def test_unknown_source_architecture(tmp_path):
    source = save_hf_model(tmp_path / "src", "llama")
    config = json.loads((source / "config.json").read_text())
    config["model_type"] = "gpt2"
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="unknown architecture model_type='gpt2'"):
        build_hydra(source, tmp_path / "hydra")


def test_cli_build_and_inspect(base, tmp_path, capsys):
    out = tmp_path / "hydra"
    argv = [
        "build",
        "--from",
        str(base),
        "--trunk-layers",
        "3",
        "--heads",
        "2",
        "--out",
        str(out),
        "--uncertainty-head",
    ]
    assert main(argv) == 0
    assert "writing trunk (3 layers)" in capsys.readouterr().err
    assert main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layers       4: trunk 0..2, heads 3..3" in text
    for name in ("trunk", "head0", "head1", "uncertainty"):
        assert f"\n{name} " in text
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_build_with_layers(base, tmp_path, capsys):
    out = tmp_path / "hydra"
    argv = ["build", "--from", str(base), "--heads", "1", "--out", str(out)]
    assert main([*argv, "--layers", "3", "--trunk-layers", "2"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "layers       3: trunk 0..1, heads 2..2" in capsys.readouterr().out
    assert main([*argv, "--layers", "9", "--trunk-layers", "2", "--force"]) == 2
    assert "--layers 9 is out of range" in capsys.readouterr().err
