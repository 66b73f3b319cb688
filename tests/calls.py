"""Worker calls for tests, built from positional arguments in the order the loop fills
them (one helper each)."""

from __future__ import annotations

import torch

from hydra_jury.poe import SamplingParams
from hydra_jury.workers.calls import (
    DraftCall,
    HiddenStates,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
)


def prefill(session: str, start: int, tokens) -> PrefillCall:
    return PrefillCall(session, start, torch.as_tensor(tokens, dtype=torch.long))


def draft(
    session: str,
    start: int,
    pending: int,
    gamma: int,
    draft_head: str | None,
    sampling: SamplingParams,
    seed: int,
    with_decision: bool = False,
) -> DraftCall:
    return DraftCall(session, start, pending, gamma, draft_head, sampling, seed, with_decision)


def hidden(states: torch.Tensor) -> HiddenStates:
    return HiddenStates(len(states), states)


def jury_prefill(session: str, start: int, states: torch.Tensor) -> JuryPrefillCall:
    return JuryPrefillCall(session, start, hidden(states))


def score(
    session: str,
    start: int,
    states: torch.Tensor,
    jury: list[str],
    temperature: float,
    beta: float,
    with_decision: bool = False,
) -> ScoreCall:
    return ScoreCall(session, start, hidden(states), tuple(jury), temperature, beta, with_decision)


def model_draft(
    session: str,
    start: int,
    pending: int,
    gamma: int,
    sampling: SamplingParams,
    seed: int,
    with_decision: bool = False,
) -> DraftCall:
    """Drafting with the trunk service's draft model (no head)."""
    return DraftCall(
        session, start, pending, gamma, None, sampling, seed, with_decision, draft_model=True
    )
