"""An in-process engine over the jury checkpoint, loaded once."""

from __future__ import annotations

import pytest

from orchestrator.backend import LocalBackend
from orchestrator.engine import Engine


@pytest.fixture(scope="session")
def tokenizer(jury_model):
    return jury_model.load_tokenizer()


@pytest.fixture
def engine(jury_model, tokenizer) -> Engine:
    return Engine(LocalBackend(jury_model, max_sessions=2, max_session_tokens=128), tokenizer)
