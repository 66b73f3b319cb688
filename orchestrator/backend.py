"""What the decoding loop needs from the model, and the in-process implementation.

The loop (`orchestrator.engine`) is written once against `DecodingBackend`; the
in-process backend calls the trunk and jury workers directly, and the gRPC backend
calls the same workers inside their services. Every stateful call names the position
its caches must start from (see `hydra_model.sessions`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from hydra_model import HydraModel
from jury_service.worker import JuryWorker, ScoreResult
from poe import SamplingParams
from trunk_service.worker import DraftResult, TrunkWorker


@dataclass(frozen=True)
class ModelInfo:
    head_names: tuple[str, ...]  # every `llm` head, in checkpoint order
    drafter_heads: tuple[str, ...]  # heads the trunk can draft with
    vocab_size: int
    hidden_size: int
    context_length: int  # positions a session may reach (model and worker limits)
    eos_token_ids: tuple[int, ...]


class DecodingBackend(ABC):
    info: ModelInfo

    @abstractmethod
    def prefill(self, session: str, start: int, tokens: torch.Tensor) -> None:
        """Processes tokens [T] at positions start.. in the trunk and the jury."""

    @abstractmethod
    def draft(
        self,
        session: str,
        start: int,
        pending: int,
        gamma: int,
        draft_head: str | None,
        sampling: SamplingParams,
        seed: int,
        with_decision: bool,
    ) -> DraftResult:
        """γ trunk + draft-head steps from the pending token (see `TrunkWorker.draft`)."""

    @abstractmethod
    def score(
        self,
        session: str,
        start: int,
        hidden: torch.Tensor,
        jury: list[str],
        temperature: float,
        beta: float,
        with_decision: bool,
    ) -> ScoreResult:
        """The jury's log-product (summed over shards) and votes for the draft's hidden
        states (`DraftResult.hidden` as `draft` returned it: a tensor in-process, the
        message itself over gRPC)."""

    @abstractmethod
    def release(self, session: str) -> None:
        """Frees the session's caches everywhere."""


class LocalBackend(DecodingBackend):
    """Trunk and jury in this process, sharing one loaded model's weights."""

    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        max_sessions: int = 4,
        max_session_tokens: int = 2048,
    ) -> None:
        self.model = model
        self.trunk = TrunkWorker(
            model,
            drafter_heads=drafter_heads,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
        )
        self.jury = JuryWorker(
            model, max_sessions=max_sessions, max_session_tokens=max_session_tokens
        )
        config = model.config
        self.info = ModelInfo(
            head_names=tuple(model.head_names),
            drafter_heads=tuple(self.trunk.drafters),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            context_length=self.trunk.max_session_tokens,
            eos_token_ids=config.eos_token_ids,
        )

    def prefill(self, session: str, start: int, tokens: torch.Tensor) -> None:
        self.jury.prefill(session, start, self.trunk.prefill(session, start, tokens))

    # The loop's maths runs on the host, on [γ, V] tensors, as it does over gRPC; the
    # hidden states stay on the model's device for the jury.
    def draft(
        self, session, start, pending, gamma, draft_head, sampling, seed, with_decision
    ) -> DraftResult:
        result = self.trunk.draft(
            session, start, pending, gamma, draft_head, sampling, seed, with_decision
        )
        return replace(
            result,
            tokens=_host(result.tokens),
            logprobs=_host(result.logprobs),
            decision_logprobs=_host(result.decision_logprobs),
        )

    def score(self, session, start, hidden, jury, temperature, beta, with_decision) -> ScoreResult:
        result = self.jury.score(session, start, hidden, jury, temperature, beta, with_decision)
        return replace(
            result,
            log_product=_host(result.log_product),
            decision_log_product=_host(result.decision_log_product),
            votes=_host(result.votes),
        )

    def release(self, session: str) -> None:
        self.trunk.release(session)
        self.jury.release(session)


def _host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.cpu()
