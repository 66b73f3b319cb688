"""Shared dummies for the poe tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is float maths on tensors whose thresholds and tie-breaks the CPU's
    float path could move: all of them run in `make test-numerics`."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture
def make_logits() -> Callable[..., torch.Tensor]:
    """Builds seeded random logits: make_logits(*shape, seed=0, scale=1.0) → float32."""

    def build(*shape: int, seed: int = 0, scale: float | Sequence[float] = 1.0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(*shape, generator=generator)
        # A per-row scale (last-but-one dimension) gives rows of different sharpness.
        scale_tensor = torch.as_tensor(scale, dtype=torch.float32)
        return logits * (scale_tensor[:, None] if scale_tensor.dim() == 1 else scale_tensor)

    return build
