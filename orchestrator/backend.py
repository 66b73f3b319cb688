"""What the decoding loop needs from the model: `DecodingBackend`, with two transports —
in-process (`orchestrator.local_backend`) and gRPC (`orchestrator.grpc_backend`).

Every method takes one call object from `workers.calls` and returns its result; every
stateful call names the position its caches must start from (the position rule,
`workers.sessions`), so calls are idempotent and there is no rollback call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from workers.calls import DraftCall, DraftResult, PrefillCall, ScoreCall, ScoreResult


@dataclass(frozen=True)
class ModelInfo:
    head_names: tuple[str, ...]  # every `llm` head, in checkpoint order
    drafter_heads: tuple[str, ...]  # heads the trunk can draft with
    vocab_size: int
    context_length: int  # positions a session may reach (model and worker limits)
    eos_token_ids: tuple[int, ...]


class DecodingBackend(ABC):
    info: ModelInfo

    @abstractmethod
    def prefill(self, call: PrefillCall) -> None:
        """Processes the tokens in the trunk and the jury."""

    @abstractmethod
    def draft(self, call: DraftCall) -> DraftResult:
        """γ trunk + draft-head steps from the pending token (`workers.trunk`). The
        result's tensors are on the host; its hidden states are an opaque handle."""

    @abstractmethod
    def score(self, call: ScoreCall) -> ScoreResult:
        """The whole jury's log-product (the shards' partials added) and votes, in
        checkpoint order, on the host."""

    @abstractmethod
    def release(self, session: str) -> None:
        """Frees the session's caches everywhere (best effort)."""
