"""One request in progress (`Run`): its options, its caches, what it has committed (a
`Progress`, which is also what a session record keeps to resume it elsewhere), and the
pieces of state that live only as long as the request."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.context import Context

from hydra_jury.orchestrator.auto import AutoState
from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer
from hydra_jury.orchestrator.draft_ahead import AheadPolicy, DraftAhead
from hydra_jury.orchestrator.output import FinishReason, GenerationOutput, Progress, TokenRecord
from hydra_jury.orchestrator.request import DrafterKind, PreparedRequest
from hydra_jury.orchestrator.round_timer import RoundTimer
from hydra_jury.orchestrator.stopping import StopConditions
from hydra_jury.poe import Hypothesis, NgramIndex
from hydra_jury.workers.calls import UncertaintyResult


@dataclass
class Run:
    prepared: PreparedRequest
    session: str  # the id of the caches on the services
    committed: list[int]  # context and generated tokens
    progress: Progress
    detokenizer: IncrementalDetokenizer
    stopping: StopConditions
    keep_caches: bool = False  # a session's caches outlive the request
    records: list[TokenRecord] = field(default_factory=list)
    timer: RoundTimer = field(default_factory=RoundTimer)  # of the round in progress
    auto: AutoState | None = None  # the automatic mode's state, with drafter "auto"
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # prompt lookup in `committed`
    rounds_by_drafter: dict[DrafterKind, int] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # beam search's, best first
    judged: UncertaintyResult | None = None  # the uncertainty head's verdict, when asked
    # The trace context of the last round's span: its commit continues it (`tracing`).
    trace_context: Context | None = None
    ahead: DraftAhead | None = None  # a draft in flight for the next round
    ahead_policy: AheadPolicy = field(default_factory=AheadPolicy)  # whether to send one
    drafts_ahead: int = 0  # drafts sent ahead by this request's rounds
    drafts_ahead_used: int = 0  # of which a round used (the others were discarded)

    @property
    def start(self) -> int:
        """The processed length: where the next round's caches start."""
        return len(self.committed) - 1

    @property
    def finished(self) -> bool:
        return self.progress.finish_reason is not None

    def snapshot(self) -> Progress:
        """A copy of the progress so far, to store (the request goes on changing its own)."""
        snapshot = Progress.from_dict(self.progress.to_dict())
        snapshot.detokenizer_offsets = self.detokenizer.offsets
        return snapshot

    def output(self, tokenizer, auto_inputs: dict[str, float]) -> GenerationOutput:
        """The whole output of the finished request."""
        prepared, progress = self.prepared, self.progress
        return GenerationOutput(
            text=progress.text,
            token_ids=progress.generated,
            tokens=self.records,
            finish_reason=progress.finish_reason or FinishReason.LENGTH,
            stats={
                **progress.stats.to_dict(),
                "prefilled_tokens": progress.prefilled_tokens,
                "reused_tokens": progress.reused_tokens,
                "resumed_rounds": progress.resumed_rounds,
                "rounds_by_drafter": dict(self.rounds_by_drafter),
                "auto_inputs": auto_inputs,
                "drafts_ahead": self.drafts_ahead,
                "drafts_ahead_used": self.drafts_ahead_used,
            },
            seed=prepared.seed,
            draft_head=prepared.draft_head,
            jury=prepared.jury,
            prompt_tokens=len(prepared.prompt_tokens),
            rounds=progress.round_sizes,
            session=self.session,
            beam_score=self.hypotheses[0].score if self.hypotheses else None,
            beams=self._beams(tokenizer) if prepared.request.return_beams else [],
            p_correct=self.judged.p_correct if self.judged else None,
            witness_head=self.judged.witness_head if self.judged else "",
        )

    def _beams(self, tokenizer) -> list[dict]:
        return [
            {
                "token_ids": list(hypothesis.tokens),
                "text": tokenizer.decode(list(hypothesis.tokens), skip_special_tokens=True),
                "score": hypothesis.score,
                "logprob": hypothesis.logprob,
            }
            for hypothesis in self.hypotheses
        ]
