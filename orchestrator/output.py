"""What a generation returns: per-token records, per-round messages, the whole output;
and what a round decided (`Verdict`), from which its token records are made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import torch

from hydra_jury.orchestrator.request import DrafterKind
from hydra_jury.poe import (
    RequestStats,
    TargetRows,
    stability_radius,
    suppression_score,
    token_logprobs,
    top_logprobs,
    validity_radius,
)


class TokenKind(StrEnum):
    DRAFT = "draft"  # a draft token kept
    REPLACEMENT = "replacement"  # drawn from the residual after a rejection
    SAMPLE = "sample"  # drawn from the target with no draft (verifier_only)
    BONUS = "bonus"  # drawn from the target after a one-pass round kept every draft
    BEAM = "beam"  # of the best hypothesis of a beam search


class FinishReason(StrEnum):
    EOS = "eos"  # an end-of-sequence token was emitted (and is the last token)
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop sequence completed (the text ends before it)


@dataclass
class TokenRecord:
    """One emitted token and its metrics (None where the rule computed no target, as for
    drafter_only)."""

    token_id: int
    text: str
    position: int  # absolute position in the sequence
    kind: TokenKind
    entropy: float | None = None  # of the target P at this position, nats
    votes: dict[str, int] | None = None  # juror -> its argmax token
    stability_radius: int | None = None
    stability_margin: float | None = None
    rejected_token: int | None = None  # replacement only: the draft token it replaced
    rejected_text: str | None = None
    validity_radius: int | None = None  # replacement only
    suppression_score: float | None = None  # replacement only: P(rejected token)
    # Asked for (`logprobs`): log P(token), and the most likely tokens at this position,
    # most likely first ({"token_id", "text", "logprob"} each).
    logprob: float | None = None
    top_logprobs: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its fields as a dict sharing their values (the kind a `StrEnum`, a string to
        JSON): what a round's commit stores. `asdict` deep-copied each first: 22 µs for
        a token with four jurors' votes, on the server's event loop every round; 0.5 µs
        this way (2-core Intel Xeon)."""
        return dict(vars(self))


@dataclass
class Verdict:
    """What one round decided, before stop conditions: its tokens and, where a target
    was computed, what the per-token metrics are read from."""

    tokens: list[int]
    kinds: list[TokenKind]
    drafted: int
    accepted: int
    drafter: DrafterKind
    target: TargetRows | None = None  # the unfiltered target's rows and their metrics
    votes: torch.Tensor | None = None  # [rows, J]
    voters: tuple[str, ...] = ()
    rejected: int | None = None  # the draft token the replacement took the place of
    bonus: bool = False  # a one-pass round kept every draft and drew one more token
    sent_ahead: bool = False  # the round sent the next round's draft ahead
    used_ahead: bool = False  # the round's draft was one an earlier round sent ahead


def token_records(
    text_of: Callable[[int], str],
    verdict: Verdict,
    tokens: list[int],
    first_position: int,
    logprobs: int | None = None,
) -> list[TokenRecord]:
    """The records of the round's emitted `tokens` (the verdict's, up to a stop
    condition) at positions from `first_position`, with the target's metrics; with
    `logprobs` (not None), each token's log-probability and that many most likely tokens.
    `text_of`: a token's own text (`detokenizer.TokenTexts`)."""
    records = [
        TokenRecord(token, text_of(token), first_position + i, kind)
        for i, (token, kind) in enumerate(zip(tokens, verdict.kinds, strict=False))
    ]
    if verdict.target is None or not records:
        return records
    # Whole rows to lists, cut here: a round has at most γ + 1 of them, and each tensor
    # operation costs more than that right after a model step.
    target = verdict.target.logprobs
    entropies = verdict.target.entropy.tolist()
    margins = verdict.target.margin.tolist()
    vote_lists = verdict.votes.tolist()
    for i, record in enumerate(records):
        record.entropy, record.stability_margin = entropies[i], margins[i]
        record.stability_radius = stability_radius(vote_lists[i], record.token_id)
        record.votes = dict(zip(verdict.voters, vote_lists[i], strict=True))
        if record.kind == TokenKind.REPLACEMENT:
            rejected = verdict.rejected
            record.rejected_token = rejected
            record.rejected_text = text_of(rejected)
            record.validity_radius = validity_radius(vote_lists[i], rejected)
            record.suppression_score = float(
                suppression_score(target[i : i + 1], torch.tensor([rejected]))[0]
            )
    if logprobs is not None:
        _add_logprobs(text_of, records, target[: len(records)], torch.tensor(tokens), logprobs)
    return records


def _add_logprobs(
    text_of: Callable[[int], str],
    records: list[TokenRecord],
    target: torch.Tensor,
    tokens: torch.Tensor,
    top: int,
) -> None:
    chosen = token_logprobs(target, tokens).tolist()
    likeliest, values = top_logprobs(target, top)
    for record, logprob, ids, logprobs in zip(
        records, chosen, likeliest.tolist(), values.tolist(), strict=True
    ):
        record.logprob = logprob
        record.top_logprobs = [
            {"token_id": token, "text": text_of(token), "logprob": value}
            for token, value in zip(ids, logprobs, strict=True)
        ]


@dataclass
class RoundOutput:
    """The tokens one round committed, sent as soon as they are committed."""

    index: int
    tokens: list[TokenRecord]
    text: str  # text delta of this round
    finish_reason: FinishReason | None = None  # set on the last round
    drafted: int = 0  # draft tokens this round verified (up to a stop condition)
    accepted: int = 0  # of which kept
    # Wall time of the round: draft_s (draft call), score_s (jury call), accept_s (the
    # rest: acceptance, sampling, metrics, commit).
    timings: dict[str, float] = field(default_factory=dict)
    drafter: DrafterKind = DrafterKind.NONE  # who drafted this round
    draft_head: str | None = None  # the head that drafted it (drafter "head" only)
    sent_ahead: bool = False  # pipelined: it sent the next round's draft ahead
    used_ahead: bool = False  # pipelined: its draft was sent ahead by the round before


@dataclass
class Progress:
    """What a generation has committed so far, without the per-token records: enough,
    with the committed tokens and those records, to resume it in another process."""

    generated: list[int] = field(default_factory=list)
    round_sizes: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    text: str = ""  # of the generated tokens, up to a stop sequence
    sent: int = 0  # characters of `text` handed out in round deltas
    detokenizer_offsets: tuple[int, int] = (0, 0)
    finish_reason: FinishReason | None = None
    prefilled_tokens: int = 0  # context tokens this request processed
    reused_tokens: int = 0  # context tokens the session's caches already held
    resumed_rounds: int = 0  # rounds committed before the last resume

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy that shares no list with this progress, made field by field:
        `asdict` deep-copied every committed token one by one for each round's snapshot
        (0.6 ms a round at 128 tokens, and growing with the text)."""
        values = {item.name: getattr(self, item.name) for item in fields(self)}
        values["generated"] = list(self.generated)
        values["round_sizes"] = list(self.round_sizes)
        values["stats"] = self.stats.counters()
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Progress:
        progress = cls(**{**values, "stats": RequestStats(**values["stats"])})
        progress.detokenizer_offsets = tuple(progress.detokenizer_offsets)
        if progress.finish_reason is not None:
            progress.finish_reason = FinishReason(progress.finish_reason)
        return progress


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    tokens: list[TokenRecord]
    finish_reason: FinishReason
    stats: dict[str, Any]
    seed: int
    draft_head: str | None
    jury: list[str]
    prompt_tokens: int
    rounds: list[int] = field(default_factory=list)  # tokens committed by each round
    session: str = ""  # the session (or, without one, the id of the caches it used)
    request_id: str = ""
    beam_score: float | None = None  # beam search: the best hypothesis's score
    # beam search with return_beams: every kept hypothesis, best first
    # ({"token_ids", "text", "score", "logprob"})
    beams: list[dict[str, Any]] = field(default_factory=list)
    # With `uncertainty`: the uncertainty head's P(the answer is correct), and the head
    # whose hidden state it read (`hydra_model.uncertainty`).
    p_correct: float | None = None
    witness_head: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GenerationOutput:
        output = cls(**values)
        output.tokens = [token_record_from_dict(t) for t in output.tokens]
        output.finish_reason = FinishReason(output.finish_reason)
        return output


def token_record_from_dict(values: dict[str, Any]) -> TokenRecord:
    record = TokenRecord(**values)
    record.kind = TokenKind(record.kind)
    return record
