"""An in-process engine over the jury checkpoint, loaded once."""

from __future__ import annotations

import pytest

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.workers.sessions import SessionLimits


@pytest.fixture(scope="session")
def tokenizer(jury_model):
    return jury_model.load_tokenizer()


@pytest.fixture
def engine(jury_model, tokenizer) -> Engine:
    return Engine(LocalBackend(jury_model, limits=SessionLimits(2, 128)), tokenizer)


@pytest.fixture
def model_engine(jury_model, tokenizer, draft_model) -> Engine:
    """The engine with a draft model on its trunk (the jury's base model, whole)."""
    backend = LocalBackend(jury_model, draft_model=draft_model, limits=SessionLimits(2, 128))
    return Engine(backend, tokenizer)
