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
- stop condition (`orchestrator.stopping`): an end-of-sequence token, a stop sequence,
  or the token limit. A round is cut after the token that meets one; the tokens after
  it were never emitted, and the request statistics count the round as if it had
  drafted only up to it.

The engine runs a request's rounds: `Rounds.decide` (`orchestrator.rounds`: draft,
score, verify) and then `_commit` (stop conditions, records, progress). Written once
against `DecodingBackend`: the in-process and gRPC transports share it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import torch

from hydra_jury.hydra_model.uncertainty import check_tokens, verdict_tokens
from hydra_jury.orchestrator.auto import AutoState, CostModel
from hydra_jury.orchestrator.backend import DecodingBackend
from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer, TokenTexts
from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.orchestrator.output import (
    GenerationOutput,
    Progress,
    RoundOutput,
    TokenRecord,
    Verdict,
    token_records,
)
from hydra_jury.orchestrator.request import (
    DrafterKind,
    GenerationRequest,
    PreparedRequest,
    prepare_request,
)
from hydra_jury.orchestrator.round_timer import RoundTimer
from hydra_jury.orchestrator.rounds import Rounds
from hydra_jury.orchestrator.run import Run
from hydra_jury.orchestrator.stopping import StopConditions
from hydra_jury.serving import tracing
from hydra_jury.workers.calls import PrefillCall, UncertaintyCall, UncertaintyResult
from hydra_jury.workers.errors import PositionError

# Times one round may rebuild lost caches before the request fails: under load a full
# service may give an idle session's slot away again while the first rebuild waits.
REBUILDS_PER_ROUND = 3


class Engine:
    def __init__(
        self, backend: DecodingBackend, tokenizer, limits: RequestLimits | None = None
    ) -> None:
        """`limits`: a server's hard limits on requests (None: only the model's)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # a token record's text
        self.window_texts = TokenTexts(tokenizer, skip_special_tokens=True)  # detokenizers'
        self.limits = limits
        self.costs = CostModel()  # the automatic mode's measured round costs
        self.rounds = Rounds(backend, self.costs)

    def prepare(
        self, request: GenerationRequest, context: list[int] | None = None
    ) -> PreparedRequest:
        """Checks every option and resolves defaults; raises `RequestError` before any
        compute. `context`: the tokens to continue, in place of the request's input."""
        return prepare_request(request, self.backend.info, self.tokenizer, context, self.limits)

    def start(self, request: GenerationRequest, session: str | None = None) -> Generation:
        """Checks the request (raising `RequestError` before any compute) and returns the
        generation, to be iterated round by round. `session` names its caches on the
        services (default: a fresh id); they are released when it ends."""
        prepared = self.prepare(request)
        return self.begin(prepared, session or uuid.uuid4().hex, keep_caches=False)

    def begin(
        self,
        prepared: PreparedRequest,
        cache: str,
        *,
        reused: int = 0,
        progress: Progress | None = None,
        records: list[TokenRecord] | None = None,
        keep_caches: bool = True,
    ) -> Generation:
        """A generation over `prepared` on the caches named `cache`, which hold the first
        `reused` context tokens (a session's earlier turns). With `progress` (and the
        `records` of its rounds) it resumes a generation committed elsewhere; random
        draws are keyed by position, so it goes on exactly as the interrupted one would.
        With `keep_caches` the caches stay on the services when it ends."""
        progress = Progress.from_dict(progress.to_dict()) if progress else Progress()
        committed = list(prepared.prompt_tokens) + progress.generated
        progress.reused_tokens = min(reused, len(committed) - 1)
        # The pending token is processed by this request's first round.
        progress.prefilled_tokens += 1
        progress.resumed_rounds = len(progress.round_sizes)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, progress.generated, progress.detokenizer_offsets, self.window_texts
        )
        eos = self.backend.info.eos_token_ids
        # On the request's span: the options it runs with, as resolved.
        tracing.annotate(
            rule=str(prepared.rule),
            gamma=prepared.gamma,
            jury=prepared.jury,
            draft_head=prepared.draft_head,
            drafter=str(prepared.drafter),
            seed=prepared.seed,
        )
        run = Run(
            prepared,
            cache,
            committed,
            progress,
            detokenizer,
            StopConditions(prepared.request, eos, detokenizer, progress),
            keep_caches=keep_caches,
            records=list(records or []),
            auto=AutoState.starting(self.costs) if prepared.drafter == DrafterKind.AUTO else None,
            ahead_policy=self.rounds.ahead_pool.starting(),
        )
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

    def output(self, run: Run) -> GenerationOutput:
        auto_inputs = run.auto.inputs(self.costs) if run.auto else {}
        return run.output(self.tokenizer, auto_inputs)

    def _rounds(self, run: Run) -> Iterator[RoundOutput]:
        self.costs.started()  # the load the automatic mode's costs are kept under
        try:
            try:
                self._prefill(run, run.progress.reused_tokens)
            except PositionError:
                # A service no longer holds what the session's record says it does.
                self._prefill(run, 0)
            while not run.finished:
                run.timer = RoundTimer()
                with tracing.span("round", index=len(run.progress.round_sizes)):
                    output = self.backend.run_round(self._round_and_commit, run)
                    tracing.annotate(
                        drafter=str(output.drafter),
                        drafted=output.drafted,
                        accepted=output.accepted,
                        tokens=len(output.tokens),
                        finish_reason=output.finish_reason and str(output.finish_reason),
                    )
                    run.trace_context = tracing.context()
                output.timings = run.timer.timings()
                yield output
        finally:
            self.costs.ended()
            self.rounds.settle(run)  # no call of the session in flight past its end
            if run.keep_caches:
                self.backend.finish(run.session)
            else:
                self.backend.release(run.session)

    def _round_and_commit(self, run: Run) -> RoundOutput:
        for attempt in range(REBUILDS_PER_ROUND + 1):
            try:
                verdict = self.rounds.decide(run)
                break
            except PositionError:
                if attempt == REBUILDS_PER_ROUND:
                    raise
                # A service lost this session's caches (it restarted, or, full, gave the
                # slot of a session idle too long to another): rebuild them from the
                # committed tokens and run the round again.
                self.rounds.settle(run)
                self._prefill(run, 0)
        output = self._commit(run, verdict)
        if output.finish_reason is not None and run.prepared.request.uncertainty:
            run.judged = self._judge(run)
        return output

    def _judge(self, run: Run) -> UncertaintyResult | None:
        """The uncertainty head's second pass over the finished answer: the question (the
        last message, or the prompt) and the answer's text, as `check_tokens` words them."""
        generated = run.progress.generated
        if not generated:
            return None
        request = run.prepared.request
        question = request.messages[-1]["content"] if request.messages else request.prompt
        call = UncertaintyCall(
            torch.tensor(run.prepared.prompt_tokens),
            generated[0],
            torch.tensor(check_tokens(self.tokenizer, question or "", run.progress.text)),
            verdict_tokens(self.tokenizer),
        )
        return self.backend.uncertainty(run.session, call)

    @tracing.spanned("prefill")
    def _prefill(self, run: Run, start: int) -> None:
        """The committed tokens from `start` on, but the pending one, into every component
        (the position rule drops whatever the caches held from `start` on)."""
        progress = run.progress
        if start < run.start:
            tokens = torch.tensor(run.committed[start:-1])
            heads = run.prepared.scoring_heads
            self.backend.prefill(PrefillCall(run.session, start, tokens, heads))
            progress.prefilled_tokens += len(tokens)
        progress.reused_tokens = min(progress.reused_tokens, start)

    # --- commit ----------------------------------------------------------------------

    def _commit(self, run: Run, verdict: Verdict) -> RoundOutput:
        progress = run.progress
        tokens, finish = run.stopping.push(verdict.tokens)
        drafted, accepted = verdict.drafted, verdict.accepted
        if len(tokens) < len(verdict.tokens):
            # Cut by a stop condition: only accepted draft tokens can precede the cut
            # (a replacement is always a round's last token), so the round decided on
            # exactly the positions it emitted.
            drafted = accepted = len(tokens)
        bonus = verdict.bonus and len(tokens) == len(verdict.tokens)
        progress.stats.observe_round(drafted, accepted, bonus)
        run.rounds_by_drafter[verdict.drafter] = run.rounds_by_drafter.get(verdict.drafter, 0) + 1
        run.drafts_ahead += verdict.sent_ahead
        run.drafts_ahead_used += verdict.used_ahead
        request = run.prepared.request
        logprobs = request.top_logprobs if request.logprobs else None
        records = token_records(self.token_texts, verdict, tokens, len(run.committed), logprobs)
        run.committed += tokens
        progress.generated += tokens
        run.records += records
        progress.round_sizes.append(len(tokens))
        progress.finish_reason = finish
        return RoundOutput(
            len(progress.round_sizes) - 1,
            records,
            run.stopping.delta(),
            finish,
            drafted,
            accepted,
            drafter=verdict.drafter,
            draft_head=run.prepared.draft_head if verdict.drafter == DrafterKind.HEAD else None,
            sent_ahead=verdict.sent_ahead,
            used_ahead=verdict.used_ahead,
        )


class Generation:
    """One request in progress: iterate it for its rounds; `close()` stops it early and
    frees its caches; `result()` is the whole output once the last round is out."""

    def __init__(self, engine: Engine, run: Run) -> None:
        self._engine, self._run = engine, run
        self._rounds = engine._rounds(run)

    @property
    def session(self) -> str:
        return self._run.session

    @property
    def trace_context(self):
        """The trace context of the last round's span (`tracing.attached`)."""
        return self._run.trace_context

    @property
    def committed(self) -> list[int]:
        """Context and generated tokens so far."""
        return self._run.committed

    def progress(self) -> Progress:
        return self._run.snapshot()

    def __iter__(self) -> Iterator[RoundOutput]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()

    def result(self) -> GenerationOutput:
        if not self._run.finished:
            raise RuntimeError("the generation has not finished")
        return self._engine.output(self._run)
