"""Shared fixtures: tiny random source models and Hydra checkpoints, built once per run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hydra_jury.kernels.native import INSTRUCTION_SETS, instruction_set, native
from hydra_jury.orchestrator.sessions.redis_server import LocalRedis
from tests.environment import THREADS_VARIABLE, describe
from tests.models import build_draft_checkpoint, build_hydra, build_jury_checkpoint, save_hf_model

# Fixtures that start real trunk and jury services (start_trunk, start_jury, trunk, jury).
pytest_plugins = ["tests.worker_services"]

# Tiny models: one thread avoids the cost of spreading microsecond ops over cores.
# `make test-numerics` sets the variable to run the float-path tests with 2 as well.
torch.set_num_threads(int(os.environ.get(THREADS_VARIABLE, "1")))


def pytest_report_header() -> list[str]:
    """The CPU, float path and package versions, at the top of every run's output."""
    return describe()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding tests marked slow first, then the others by how many tests they
    hold, most first; a file's tests keep their order. `make test` hands each of its
    processes a whole file at a time, in this order (`--dist loadfile
    --no-loadscope-reorder`): the longest files start first, and the run does not end
    with one process alone on a long file that was handed out last (the distribution
    tests were: 197 s from 121 s in, 20 s after the other processes stopped)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[bool, int]:
        return (not any(test.get_closest_marker("slow") for test in tests), -len(tests))

    items[:] = [test for tests in sorted(files.values(), key=weight) for test in tests]


@pytest.fixture(scope="session", autouse=True)
def built_kernels() -> None:
    """The native kernels built (or loaded from their cache) before any test runs. They
    are compiled on first use, about a minute on 2 cores: inside a test that serves a
    model, that first use spent the test's gRPC deadline (a fresh cache and one test file
    run alone; `make test` builds them in `make setup` first)."""
    native()


@pytest.fixture
def kernels() -> Iterator[list[str]]:
    """The instruction sets the native kernels can run here (a test switches between
    them with `instruction_set`; the one in use is put back after it)."""
    if native() is None:
        pytest.skip("no native kernels on this machine")
    chosen = instruction_set()
    yield [name for name in INSTRUCTION_SETS if _supported(name)]
    instruction_set(chosen)


def _supported(name: str) -> bool:
    try:
        instruction_set(name)
    except RuntimeError:
        return False
    return True


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


@pytest.fixture(scope="session")
def jury_checkpoint(tmp_path_factory) -> Path:
    """The checkpoint most tests run on (`build_jury_checkpoint`): 2 trunk layers and 2
    head layers, hidden size 64, 4 heads that really differ."""
    return build_jury_checkpoint(tmp_path_factory.mktemp("jury"), trunk_layers=2)


@pytest.fixture(scope="session")
def wide_jury_checkpoint(tmp_path_factory) -> Path:
    """The jury checkpoint with attention heads 32 wide (2 query heads, 1 key/value head):
    the shapes the native attention and the one-call decode of every layer take
    (`kernels/`), which the 16-wide heads of `jury_checkpoint` leave to
    PyTorch's attention."""
    root = tmp_path_factory.mktemp("wide-jury")
    return build_jury_checkpoint(
        root, trunk_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )


@pytest.fixture(scope="session")
def jury_model(jury_checkpoint):
    """The whole jury checkpoint loaded once, for calling the runtime and workers directly."""
    from hydra_jury.hydra_model import HydraModel

    return HydraModel.load(jury_checkpoint)


@pytest.fixture(scope="session")
def draft_checkpoint(jury_checkpoint) -> Path:
    """A draft model for the jury checkpoint: the whole base model its heads were tuned
    from (4 layers, as a trunk of 3 and one head), with the same tokenizer."""
    return build_draft_checkpoint(jury_checkpoint)


@pytest.fixture(scope="session")
def draft_model(draft_checkpoint):
    from hydra_jury.hydra_model import DraftModel

    return DraftModel.load(draft_checkpoint)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real redis-server on a free loopback port, for the whole run; each stack keeps
    its sessions under a key prefix of its own."""
    with LocalRedis() as server:
        yield server.url
