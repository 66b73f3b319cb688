"""The speculative Product-of-Experts decoding loop, in pending-token form.

Terms
- committed: prompt and generated tokens so far. Every component has processed all but
  the last, the *pending* token, so the processed length is n = len(committed) - 1.
- round: draft γ tokens from the pending one (trunk + draft head), score them with the
  jury in one call, accept left to right, commit. With `a` kept and a replacement, n
  grows by a + 1 and the replacement is pending; with all γ kept, n grows by γ and the
  last draft token is pending. No forward pass runs after a rejection: the next round's
  first trunk step processes the pending token.
- baselines: `verifier_only` takes one trunk step and one jury call per token and
  samples from the target; `drafter_only` keeps every draft token and calls no jury.

Written once against `DecodingBackend`: the in-process and gRPC transports share it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hydra_model.sessions import PositionError
from orchestrator.backend import DecodingBackend
from orchestrator.output import GenerationOutput, RoundOutput, TokenRecord
from orchestrator.request import GenerationRequest, PreparedRequest, prepare_request
from poe import (
    RequestStats,
    acceptance_probs,
    categorical,
    entropy,
    filter_logprobs,
    greedy_verdict,
    normalise_logprobs,
    residual_probs,
    stability_margin,
    stability_radius,
    uniforms,
    validity_radius,
)


@dataclass
class _Verdict:
    """What one round decided, before stop conditions."""

    tokens: list[int]
    drafted: int
    accepted: int
    kinds: list[str]
    target_probs: torch.Tensor | None = None  # [rows, V] unfiltered target, for metrics
    votes: torch.Tensor | None = None  # [rows, J]
    voters: list[str] = field(default_factory=list)
    rejected: int | None = None  # the draft token the replacement took the place of
    timings: dict[str, float] = field(default_factory=dict)  # draft_s, score_s


@dataclass
class _Run:
    prepared: PreparedRequest
    session: str
    committed: list[int]
    generated: list[int] = field(default_factory=list)
    records: list[TokenRecord] = field(default_factory=list)
    round_sizes: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    text: str = ""
    finish_reason: str | None = None


class Engine:
    def __init__(self, backend: DecodingBackend, tokenizer) -> None:
        self.backend = backend
        self.tokenizer = tokenizer

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Checks every option and resolves defaults; raises `RequestError` before any
        compute."""
        return prepare_request(request, self.backend.info, self.tokenizer)

    def start(self, request: GenerationRequest, session: str | None = None) -> Generation:
        """Checks the request (raising `RequestError` before any compute) and returns the
        generation, to be iterated round by round. `session` names its caches on the
        services (default: a fresh id)."""
        prepared = self.prepare(request)
        run = _Run(prepared, session or uuid.uuid4().hex, list(prepared.prompt_tokens))
        return Generation(self, run)

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        generation = self.start(request)
        for _ in generation:
            pass
        return generation.result()

    def stream(self, request: GenerationRequest) -> Iterator[RoundOutput]:
        """Yields each round's tokens as soon as they are committed. The request is
        checked now, before the first round runs."""
        return iter(self.start(request))

    def _rounds(self, run: _Run) -> Iterator[RoundOutput]:
        try:
            self._prefill(run)
            while run.finish_reason is None:
                began = time.perf_counter()
                try:
                    verdict = self._round(run)
                except PositionError:
                    # A service lost this session's caches (it restarted): rebuild them
                    # from the committed tokens, once, and run the round again.
                    self._prefill(run)
                    verdict = self._round(run)
                output = self._commit(run, verdict)
                spent = time.perf_counter() - began
                output.timings = {
                    **verdict.timings,
                    "accept_s": spent - sum(verdict.timings.values()),
                }
                yield output
        finally:
            self.backend.release(run.session)

    def _prefill(self, run: _Run) -> None:
        """Every committed token but the pending one, into every component."""
        if len(run.committed) > 1:
            self.backend.prefill(run.session, 0, torch.tensor(run.committed[:-1]))

    def _round(self, run: _Run) -> _Verdict:
        prepared, request = run.prepared, run.prepared.request
        start, pending = len(run.committed) - 1, run.committed[-1]
        gamma = min(request.gamma, request.max_new_tokens - len(run.generated))
        if request.rule == "verifier_only":
            gamma = 1
        # Cascade rules decide with temperature-1, unfiltered distributions.
        with_decision = request.rule.startswith("cascade") and not prepared.sampling.greedy
        began = time.perf_counter()
        draft = self.backend.draft(
            run.session,
            start,
            pending,
            gamma,
            prepared.draft_head,
            prepared.sampling,
            prepared.seed,
            with_decision,
        )
        drafted_at = time.perf_counter()
        timings = {"draft_s": drafted_at - began, "score_s": 0.0}
        run.stats.trunk_steps += draft.trunk_steps
        run.stats.head_evaluations += draft.head_evaluations
        draft_tokens = draft.tokens.tolist()
        if request.rule == "drafter_only":
            return _Verdict(draft_tokens, gamma, gamma, ["draft"] * gamma, timings=timings)
        score = self.backend.score(
            run.session,
            start,
            draft.hidden,
            prepared.jury,
            request.temperature,
            request.beta,
            with_decision,
        )
        run.stats.head_evaluations += score.head_evaluations
        timings["score_s"] = time.perf_counter() - drafted_at
        target_logprobs = normalise_logprobs(score.log_product)  # [γ, V]
        target_probs = target_logprobs.exp()
        positions = torch.arange(start + 1, start + 1 + gamma)  # of the decided tokens
        if request.rule == "verifier_only":
            if prepared.sampling.greedy:
                token = int(target_logprobs[0].argmax())
            else:
                filtered = filter_logprobs(target_logprobs, prepared.sampling).exp()
                token = int(categorical(filtered, prepared.seed, positions, "sample")[0])
            return _Verdict(
                [token],
                0,
                0,
                ["sample"],
                target_probs,
                score.votes,
                score.voters,
                timings=timings,
            )

        rule, lenience = request.rule, request.lenience
        if prepared.sampling.greedy:
            draft_probs = draft.logprobs.exp()
            accepted, replacements = greedy_verdict(
                rule, lenience, draft.tokens, draft_probs, target_probs
            )
            accepted_count = _leading_true(accepted)
            replacement = int(replacements[accepted_count]) if accepted_count < gamma else None
        else:
            draft_probs = draft.logprobs.exp()
            sampled_target = filter_logprobs(target_logprobs, prepared.sampling).exp()
            decision_draft = draft.decision_logprobs.exp() if with_decision else draft_probs
            decision_target = (
                normalise_logprobs(score.decision_log_product).exp()
                if with_decision
                else sampled_target
            )
            keep = acceptance_probs(
                rule,
                lenience,
                draft_probs,
                sampled_target,
                draft.tokens,
                decision_draft,
                decision_target,
            )
            draws = uniforms(prepared.seed, positions, "accept")
            accepted_count = _leading_true(draws < keep.double())
            replacement = None
            if accepted_count < gamma:
                row = slice(accepted_count, accepted_count + 1)
                residual = residual_probs(
                    rule,
                    lenience,
                    draft_probs[row],
                    sampled_target[row],
                    decision_draft[row],
                    decision_target[row],
                )
                replacement = int(
                    categorical(residual, prepared.seed, positions[row], "residual")[0]
                )
        tokens = draft_tokens[:accepted_count]
        kinds = ["draft"] * accepted_count
        if replacement is not None:
            tokens.append(replacement)
            kinds.append("replacement")
        rejected = draft_tokens[accepted_count] if replacement is not None else None
        return _Verdict(
            tokens,
            gamma,
            accepted_count,
            kinds,
            target_probs,
            score.votes,
            score.voters,
            rejected,
            timings=timings,
        )

    def _commit(self, run: _Run, verdict: _Verdict) -> RoundOutput:
        run.stats.observe_round(verdict.drafted, verdict.accepted)
        request = run.prepared.request
        tokens, finish = list(verdict.tokens), None
        eos = set(self.backend.info.eos_token_ids)
        if not request.ignore_eos:
            for index, token in enumerate(tokens):
                if token in eos:
                    tokens, finish = tokens[: index + 1], "eos"
                    break
        if finish is None and request.stop:
            tokens, text, stopped = self._cut_at_stop(run, tokens)
            finish = "stop" if stopped else None
        else:
            text = self._decode(run.generated + tokens)
        records = self._records(run, verdict, tokens)
        run.committed += tokens
        run.generated += tokens
        run.records += records
        run.round_sizes.append(len(tokens))
        if finish is None and len(run.generated) >= request.max_new_tokens:
            finish = "length"
        run.finish_reason = finish
        # Hold back an incomplete character (a multi-byte sequence split between tokens).
        if finish is None and text.endswith("\ufffd"):
            text = run.text
        delta, run.text = text[len(run.text) :], text
        return RoundOutput(
            len(run.round_sizes) - 1, records, delta, finish, verdict.drafted, verdict.accepted
        )

    def _cut_at_stop(self, run: _Run, tokens: list[int]) -> tuple[list[int], str, bool]:
        """Cuts the round's tokens after the one that completes a stop sequence."""
        stops = run.prepared.request.stop
        search_from = max(0, len(run.text) - max(len(s) for s in stops) + 1)
        text = self._decode(run.generated + tokens)
        hits = [(text.find(s, search_from), s) for s in stops]
        hits = [(index, s) for index, s in hits if index >= 0]
        if not hits:
            return tokens, text, False
        index, _ = min(hits)
        for count in range(1, len(tokens) + 1):
            prefix = self._decode(run.generated + tokens[:count])
            if any(prefix.find(s, search_from) >= 0 for s in stops):
                return tokens[:count], text[:index], True
        return tokens, text[:index], True

    def _records(self, run: _Run, verdict: _Verdict, tokens: list[int]) -> list[TokenRecord]:
        first_position = len(run.committed)
        records = [
            TokenRecord(token, self.tokenizer.decode([token]), first_position + i, kind)
            for i, (token, kind) in enumerate(zip(tokens, verdict.kinds, strict=False))
        ]
        if verdict.target_probs is None or not records:
            return records
        rows = len(records)
        target = verdict.target_probs[:rows]
        emitted = torch.tensor(tokens)
        entropies = entropy(target).tolist()
        margins = stability_margin(target).tolist()
        radii = stability_radius(verdict.votes[:rows], emitted).tolist()
        votes = verdict.votes[:rows].tolist()
        for i, record in enumerate(records):
            record.entropy, record.stability_margin = entropies[i], margins[i]
            record.stability_radius = radii[i]
            record.votes = dict(zip(verdict.voters, votes[i], strict=True))
            if record.kind == "replacement":
                rejected = verdict.rejected
                record.rejected_token = rejected
                record.rejected_text = self.tokenizer.decode([rejected])
                record.validity_radius = validity_radius(votes[i], rejected)
                record.suppression_score = float(target[i, rejected])
        return records

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @staticmethod
    def _output(run: _Run) -> GenerationOutput:
        prepared = run.prepared
        return GenerationOutput(
            text=run.text,
            token_ids=run.generated,
            tokens=run.records,
            finish_reason=run.finish_reason or "length",
            stats=run.stats.to_dict(),
            seed=prepared.seed,
            draft_head=prepared.draft_head,
            jury=prepared.jury,
            prompt_tokens=len(prepared.prompt_tokens),
            rounds=run.round_sizes,
            session=run.session,
        )


class Generation:
    """One request in progress: iterate it for its rounds; `close()` stops it early and
    frees its caches; `result()` is the whole output once the last round is out."""

    def __init__(self, engine: Engine, run: _Run) -> None:
        self._run = run
        self._rounds = engine._rounds(run)

    @property
    def session(self) -> str:
        return self._run.session

    def __iter__(self) -> Iterator[RoundOutput]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()

    def result(self) -> GenerationOutput:
        if self._run.finish_reason is None:
            raise RuntimeError("the generation has not finished")
        return Engine._output(self._run)


def _leading_true(mask: torch.Tensor) -> int:
    """Number of leading True values: [T, T, F, T] -> 2."""
    return int(mask.to(torch.int64).cumprod(0).sum())
