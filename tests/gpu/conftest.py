"""The device the `gpu` tests run on: CUDA (`make test-gpu` on a GPU machine; skipped
where there is none, so CI stays CPU-only and green), or any device named in
$HYDRA_JURY_GPU_TEST_DEVICE — `cpu` runs the same tests here, to check the tests."""

from __future__ import annotations

import os

import pytest
import torch

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.workers.sessions import SessionLimits

DEVICE_VARIABLE = "HYDRA_JURY_GPU_TEST_DEVICE"


@pytest.fixture(scope="session")
def gpu_device() -> str:
    name = os.environ.get(DEVICE_VARIABLE, "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: `make test-gpu` runs these on a GPU machine")
    return name


@pytest.fixture(scope="session")
def device_model(gpu_device, jury_checkpoint) -> HydraModel:
    """The jury checkpoint on the device in float32: the exactness tests compare tokens,
    which bfloat16's rounding would decide at near-ties."""
    return HydraModel.load(jury_checkpoint, dtype="float32", device=gpu_device)


@pytest.fixture(scope="session")
def device_draft(gpu_device, draft_checkpoint) -> DraftModel:
    return DraftModel.load(draft_checkpoint, dtype="float32", device=gpu_device)


@pytest.fixture
def device_engine(device_model, device_draft) -> Engine:
    backend = LocalBackend(device_model, draft_model=device_draft, limits=SessionLimits(2, 128))
    return Engine(backend, device_model.load_tokenizer())
