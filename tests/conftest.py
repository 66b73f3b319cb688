"""Shared fixtures: tiny random source models and Hydra checkpoints, built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import build_hydra, fine_tune_top_layers, save_hf_model

# Tiny models: one thread avoids the cost of spreading microsecond ops over cores.
torch.set_num_threads(1)

FAMILY_VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "olmo2": ("olmo2", {}),
}


@pytest.fixture(scope="session")
def source_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        name: save_hf_model(root / name, family, seed=1, **overrides)
        for name, (family, overrides) in FAMILY_VARIANTS.items()
    }


@pytest.fixture(scope="session")
def hydra_checkpoints(source_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hydra")
    return {name: build_hydra(source, root / name) for name, source in source_models.items()}


JURY_VOCAB = 32
JURY_TRUNK_LAYERS = 2


@pytest.fixture(scope="session")
def jury_checkpoint(tmp_path_factory) -> Path:
    """A Llama-family Hydra checkpoint with a 32-token vocabulary and 4 heads that really
    differ: heads 0-2 come from three different fine-tunes of the top layers and LM head,
    head 3 is a copy of the base."""
    root = tmp_path_factory.mktemp("jury")
    base = save_hf_model(root / "base", "llama", seed=2, logit_scale=10.0, vocab_size=JURY_VOCAB)
    tunes = []
    for index in range(3):
        fine_tune_top_layers(base, root / f"tune{index}", JURY_TRUNK_LAYERS, seed=20 + index)
        tunes.append(str(root / f"tune{index}"))
    return build_hydra(
        base, root / "hydra", trunk_layers=JURY_TRUNK_LAYERS, heads=4, head_from=tunes
    )


@pytest.fixture(scope="session")
def jury_model(jury_checkpoint):
    """The whole jury checkpoint loaded once, for calling the runtime and workers directly."""
    from hydra_model import HydraModel

    return HydraModel.load(jury_checkpoint)
