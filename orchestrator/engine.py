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
- stop condition: an end-of-sequence token, a stop sequence, or the token limit. A
  round is cut after the token that meets one; the tokens after it were never emitted,
  and the request statistics count the round as if it had drafted only up to it.

A round is a chain of short steps: `_draft` → (`_score`) → one of `_keep_draft`,
`_sample_target`, `_accept_greedy`, `_accept_sampled` → `_commit`. Written once
against `DecodingBackend`: the in-process and gRPC transports share it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from hydra_jury.hydra_model.uncertainty import check_tokens, verdict_tokens
from hydra_jury.orchestrator.auto import AutoState, CostModel
from hydra_jury.orchestrator.backend import DecodingBackend
from hydra_jury.orchestrator.beam_search import BeamRun
from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer
from hydra_jury.orchestrator.output import (
    FinishReason,
    GenerationOutput,
    Progress,
    RoundOutput,
    TokenKind,
    TokenRecord,
)
from hydra_jury.orchestrator.request import (
    Drafter,
    GenerationRequest,
    PreparedRequest,
    prepare_request,
)
from hydra_jury.poe import (
    BeamSearch,
    Hypothesis,
    RequestStats,
    Rule,
    acceptance_probs,
    categorical,
    contrastive_logprobs,
    entropy,
    filter_logprobs,
    greedy_tokens,
    greedy_verdict,
    ngram_draft,
    normalise_logprobs,
    point_mass_logprobs,
    reached_positions,
    residual_probs,
    rule_target,
    stability_margin,
    stability_radius,
    suppression_score,
    uniforms,
    validity_radius,
)
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    PrefillCall,
    ScoreCall,
    ScoreResult,
    UncertaintyCall,
    UncertaintyResult,
)
from hydra_jury.workers.errors import PositionError

# Times one round may rebuild lost caches before the request fails: under load a full
# service may give an idle session's slot away again while the first rebuild waits.
REBUILDS_PER_ROUND = 3


@dataclass
class _Verdict:
    """What one round decided, before stop conditions."""

    tokens: list[int]
    kinds: list[TokenKind]
    drafted: int
    accepted: int
    target_probs: torch.Tensor | None = None  # [rows, V] unfiltered target, for metrics
    votes: torch.Tensor | None = None  # [rows, J]
    voters: tuple[str, ...] = ()
    rejected: int | None = None  # the draft token the replacement took the place of
    bonus: bool = False  # a one-pass round kept every draft and drew one more token
    drafter: str = "none"  # who drafted: "head", "ngram", "model", "none" (a plain step)


@dataclass
class _Run:
    prepared: PreparedRequest
    session: str  # the id of the caches on the services
    committed: list[int]
    detokenizer: IncrementalDetokenizer
    reused: int = 0  # positions the caches already hold, from a session's earlier turns
    keep_caches: bool = False  # a session's caches outlive the request
    generated: list[int] = field(default_factory=list)
    records: list[TokenRecord] = field(default_factory=list)
    round_sizes: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    text: str = ""  # the text of the generated tokens (up to a stop sequence)
    sent: int = 0  # characters of `text` handed out in round deltas
    finish_reason: FinishReason | None = None
    prefilled: int = 0
    resumed_rounds: int = 0
    auto: AutoState | None = None  # the automatic mode's state, with drafter "auto"
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # beam search's, best first
    judged: UncertaintyResult | None = None  # the uncertainty head's verdict, when asked

    @property
    def start(self) -> int:
        """The processed length: where the next round's caches start."""
        return len(self.committed) - 1

    def progress(self) -> Progress:
        return Progress(
            list(self.generated),
            list(self.round_sizes),
            asdict(self.stats),
            self.text,
            self.sent,
            self.detokenizer.offsets,
            self.finish_reason,
            self.prefilled,
            self.reused,
            self.resumed_rounds,
        )


class Engine:
    def __init__(self, backend: DecodingBackend, tokenizer) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.costs = CostModel()  # the automatic mode's measured round costs

    def prepare(
        self, request: GenerationRequest, context: list[int] | None = None
    ) -> PreparedRequest:
        """Checks every option and resolves defaults; raises `RequestError` before any
        compute. `context`: the tokens to continue, in place of the request's input."""
        return prepare_request(request, self.backend.info, self.tokenizer, context)

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
        progress = progress or Progress()
        committed = list(prepared.prompt_tokens) + progress.generated
        run = _Run(
            prepared,
            cache,
            committed,
            IncrementalDetokenizer(
                self.tokenizer, progress.generated, progress.detokenizer_offsets
            ),
            reused=min(reused, len(committed) - 1),
            keep_caches=keep_caches,
            generated=list(progress.generated),
            records=list(records or []),
            round_sizes=list(progress.round_sizes),
            stats=RequestStats(**progress.stats),
            text=progress.text,
            sent=progress.sent,
            finish_reason=progress.finish_reason,
            # The pending token is processed by this request's first round.
            prefilled=progress.prefilled_tokens + 1,
            resumed_rounds=len(progress.round_sizes),
            auto=AutoState.starting(self.costs) if prepared.drafter == Drafter.AUTO else None,
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

    def _rounds(self, run: _Run) -> Iterator[RoundOutput]:
        try:
            try:
                self._prefill(run, run.reused)
            except PositionError:
                # A service no longer holds what the session's record says it does.
                self._prefill(run, 0)
            while run.finish_reason is None:
                began = time.perf_counter()
                timings: dict[str, float] = {}
                output = self.backend.run_round(self._round_and_commit, run, timings)
                spent = time.perf_counter() - began
                output.timings = {**timings, "accept_s": spent - sum(timings.values())}
                yield output
        finally:
            if run.keep_caches:
                self.backend.finish(run.session)
            else:
                self.backend.release(run.session)

    def _round_and_commit(self, run: _Run, timings: dict[str, float]) -> RoundOutput:
        for attempt in range(REBUILDS_PER_ROUND + 1):
            try:
                verdict = self._round(run, timings)
                break
            except PositionError:
                if attempt == REBUILDS_PER_ROUND:
                    raise
                # A service lost this session's caches (it restarted, or, full, gave the
                # slot of a session idle too long to another): rebuild them from the
                # committed tokens and run the round again.
                self._prefill(run, 0)
        output = self._commit(run, verdict)
        if output.finish_reason is not None and run.prepared.request.uncertainty:
            run.judged = self._judge(run)
        return output

    def _judge(self, run: _Run) -> UncertaintyResult | None:
        """The uncertainty head's second pass over the finished answer: the question (the
        last message, or the prompt) and the answer's text, as `check_tokens` words them."""
        if not run.generated:
            return None
        request = run.prepared.request
        question = request.messages[-1]["content"] if request.messages else request.prompt
        call = UncertaintyCall(
            torch.tensor(run.prepared.prompt_tokens),
            run.generated[0],
            torch.tensor(check_tokens(self.tokenizer, question or "", run.text)),
            verdict_tokens(self.tokenizer),
        )
        return self.backend.uncertainty(run.session, call)

    def _prefill(self, run: _Run, start: int) -> None:
        """The committed tokens from `start` on, but the pending one, into every component
        (the position rule drops whatever the caches held from `start` on)."""
        if start < run.start:
            tokens = torch.tensor(run.committed[start:-1])
            self.backend.prefill(PrefillCall(run.session, start, tokens))
            run.prefilled += len(tokens)
        run.reused = min(run.reused, start)

    # --- one round -------------------------------------------------------------------

    def _round(self, run: _Run, timings: dict[str, float]) -> _Verdict:
        prepared = run.prepared
        remaining = prepared.request.max_new_tokens - len(run.generated)
        if prepared.request.num_beams > 1:
            return self._beam_round(run, timings, remaining)
        if prepared.drafter == Drafter.AUTO:
            return self._auto_round(run, timings, remaining)
        # One-pass rounds commit up to k + 1 tokens: room for the bonus under the limit.
        if prepared.drafter == Drafter.NGRAM:
            drafts = ngram_draft(run.committed, min(prepared.gamma, remaining - 1))
            return self._ngram_round(run, timings, drafts)
        if prepared.drafter == Drafter.MODEL:
            gamma = min(prepared.gamma, remaining - 1)
            return self._model_round(run, timings, gamma, coupled=False)
        gamma = 1 if prepared.rule == Rule.VERIFIER_ONLY else min(prepared.gamma, remaining)
        return self._head_round(run, timings, gamma)

    def _auto_round(self, run: _Run, timings: dict[str, float], remaining: int) -> _Verdict:
        """The round the automatic mode chooses (`orchestrator.auto`), measured for the
        next choices."""
        prepared = run.prepared
        began = time.perf_counter()
        drafts = ngram_draft(run.committed, min(prepared.gamma, remaining - 1))
        head_cap = min(prepared.gamma, remaining) if prepared.draft_head else 0
        model_cap = min(prepared.gamma, remaining - 1) if self.backend.info.draft_model else 0
        choice = run.auto.choose(
            self.costs, len(drafts), head_cap, prepared.sampling.greedy, model_cap
        )
        if choice.drafter == "head":
            verdict = self._head_round(run, timings, choice.drafts)
            kind, positions = "head", choice.drafts
        elif choice.drafter == "model":
            # Coupled under sampling: every choice gives the tokens of a plain step.
            verdict = self._model_round(run, timings, choice.drafts, coupled=True)
            kind, positions = "model", choice.drafts
        else:
            verdict = self._ngram_round(run, timings, drafts[: choice.drafts])
            kind, positions = "verify", choice.drafts + 1
        self.costs.observe(kind, positions, time.perf_counter() - began)
        reached = reached_positions(verdict.drafted, verdict.accepted)
        run.auto.observe(self.costs, choice, reached, verdict.accepted)
        return verdict

    def _beam_round(self, run: _Run, timings: dict[str, float], remaining: int) -> _Verdict:
        """The whole beam search as one round: its best hypothesis (`orchestrator.beam_search`)."""
        request = run.prepared.request
        search = BeamSearch(
            num_beams=request.num_beams,
            length_penalty=request.length_penalty,
            early_stopping=request.early_stopping,
            max_new_tokens=remaining,
            eos_token_ids=frozenset(() if request.ignore_eos else self.backend.info.eos_token_ids),
        )
        beams = BeamRun(
            self.backend,
            run.session,
            tuple(run.prepared.jury),
            request.temperature,
            request.beta,
            run.stats,
            timings,
        )
        beams.search(run.committed, search)
        run.hypotheses = search.best()
        tokens = list(run.hypotheses[0].tokens)
        return _Verdict(tokens, [TokenKind.BEAM] * len(tokens), 0, 0, drafter="beam")

    def _head_round(self, run: _Run, timings: dict[str, float], gamma: int) -> _Verdict:
        """γ draft tokens from the draft head (γ trunk steps), one jury call over them;
        verifier_only: one trunk step and one jury call, no draft."""
        rule = run.prepared.rule
        draft = self._draft(run, timings, gamma)
        if rule == Rule.DRAFTER_ONLY:
            return self._keep_draft(draft)
        score = self._score(run, draft.hidden, draft.decision_logprobs is not None, timings)
        target_logprobs = normalise_logprobs(score.log_product)  # [γ, V]
        if rule == Rule.VERIFIER_ONLY:
            return self._sample_target(run, target_logprobs, score)
        accept = self._accept_greedy if run.prepared.sampling.greedy else self._accept_sampled
        verdict = accept(run, draft, target_logprobs, score)
        verdict.drafter = "head"
        return verdict

    def _draft(
        self, run: _Run, timings: dict[str, float], gamma: int, draft_model: bool = False
    ) -> DraftResult:
        prepared = run.prepared
        plain = prepared.rule == Rule.VERIFIER_ONLY or draft_model
        call = DraftCall(
            run.session,
            run.start,
            run.committed[-1],
            gamma,
            None if plain else prepared.draft_head,
            prepared.sampling,
            prepared.seed,
            # Cascade rules decide with temperature-1, unfiltered distributions.
            with_decision=prepared.rule.is_cascade and not prepared.sampling.greedy,
            draft_model=draft_model,
        )
        began = time.perf_counter()
        draft = self.backend.draft(call)
        timings["draft_s"] = time.perf_counter() - began
        run.stats.trunk_steps += draft.trunk_steps
        run.stats.head_evaluations += draft.head_evaluations
        return draft

    def _ngram_round(self, run: _Run, timings: dict[str, float], drafts: list[int]) -> _Verdict:
        """Prompt-lookup drafts (point masses), checked in one pass; the trunk forward
        over the pending token and the k drafts is this round's only trunk call. No
        draft: a plain step."""
        prepared = run.prepared
        began = time.perf_counter()
        tokens = torch.tensor([run.committed[-1], *drafts])
        hidden = self.backend.trunk_forward(PrefillCall(run.session, run.start, tokens))
        timings["draft_s"] = time.perf_counter() - began
        run.stats.trunk_steps += len(tokens)
        draft_tokens = torch.tensor(drafts, dtype=torch.long)
        point_mass = point_mass_logprobs(draft_tokens, self.backend.info.vocab_size)
        with_decision = prepared.rule.is_cascade and not prepared.sampling.greedy
        draft = DraftResult(draft_tokens, point_mass, point_mass if with_decision else None, hidden)
        return self._check_in_one_pass(run, timings, draft, "ngram", coupled=True)

    def _model_round(
        self, run: _Run, timings: dict[str, float], gamma: int, *, coupled: bool
    ) -> _Verdict:
        """γ drafts from the trunk service's draft model, which then runs the trunk over
        the pending token and the drafts in the same call; checked in one pass. With
        `coupled`, sampled drafts are kept only where a plain step would draw them."""
        if gamma == 0:  # no room for a draft under the token limit: a plain step
            return self._ngram_round(run, timings, [])
        draft = self._draft(run, timings, gamma, draft_model=True)
        return self._check_in_one_pass(run, timings, draft, "model", coupled)

    def _check_in_one_pass(
        self, run: _Run, timings: dict[str, float], draft: DraftResult, drafter: str, coupled: bool
    ) -> _Verdict:
        """Outside draft tokens checked in one pass: `draft.hidden` holds the trunk
        outputs of the pending token and the k drafts (k+1 positions); one jury call
        scores them, acceptance runs left to right and — when all k are kept — a bonus
        token is drawn from the target at the last position. No draft: a plain step that
        samples from the target."""
        prepared = run.prepared
        score = self._score(run, draft.hidden, draft.decision_logprobs is not None, timings)
        target_logprobs = normalise_logprobs(score.log_product)  # [k + 1, V]
        k = len(draft.tokens)
        if k == 0:
            return self._sample_target(run, target_logprobs, score)
        decision = score.decision_log_product
        checked = replace(
            score,
            log_product=score.log_product[:k],
            decision_log_product=None if decision is None else decision[:k],
        )
        if prepared.sampling.greedy:
            accept = self._accept_greedy
        elif coupled and prepared.rule != Rule.LENIENT:  # lenient keeps more than π(d)
            accept = self._accept_coupled
        else:
            accept = self._accept_sampled
        verdict = accept(run, draft, target_logprobs[:k], checked)
        verdict.target_probs = target_logprobs.exp()  # every row: the bonus's metrics too
        verdict.drafter = drafter
        if verdict.accepted == k:
            verdict.tokens.append(self._draw(run, target_logprobs[k:], run.start + 1 + k))
            verdict.kinds.append(TokenKind.BONUS)
            verdict.bonus = True
        return verdict

    @staticmethod
    def _draw(run: _Run, logprobs: torch.Tensor, position: int) -> int:
        """One token from the target row `logprobs` [1, V] for `position`: its argmax
        (greedy) or a draw keyed by the position, after the filters."""
        if run.prepared.sampling.greedy:
            return int(greedy_tokens(logprobs.exp())[0])
        filtered = filter_logprobs(logprobs, run.prepared.sampling).exp()
        return int(categorical(filtered, run.prepared.seed, torch.tensor([position]), "sample")[0])

    def _score(
        self, run: _Run, hidden: HiddenStates, with_decision: bool, timings: dict[str, float]
    ) -> ScoreResult:
        prepared = run.prepared
        call = ScoreCall(
            run.session,
            run.start,
            hidden,
            tuple(prepared.jury),
            prepared.request.temperature,
            prepared.request.beta,
            with_decision=with_decision,
            amateur=prepared.amateur,
        )
        began = time.perf_counter()
        score = self.backend.score(call)
        timings["score_s"] = time.perf_counter() - began
        run.stats.head_evaluations += score.head_evaluations
        return score

    @staticmethod
    def _keep_draft(draft: DraftResult) -> _Verdict:
        """drafter_only: every draft token is kept; no jury, no metrics."""
        gamma = len(draft.tokens)
        return _Verdict(
            draft.tokens.tolist(), [TokenKind.DRAFT] * gamma, gamma, gamma, drafter="head"
        )

    @staticmethod
    def _sample_target(run: _Run, target_logprobs: torch.Tensor, score: ScoreResult) -> _Verdict:
        """verifier_only: one token from the target (or, contrastive, from the contrastive
        distribution of the target and the amateur), nothing drafted."""
        prepared = run.prepared
        chosen_from = target_logprobs
        if prepared.amateur is not None:
            alpha = prepared.request.contrastive_alpha
            chosen_from = contrastive_logprobs(target_logprobs, score.amateur_logprobs, alpha)
        token = Engine._draw(run, chosen_from, run.start + 1)
        return _Verdict(
            [token], [TokenKind.SAMPLE], 0, 0, target_logprobs.exp(), score.votes, score.voters
        )

    @staticmethod
    def _accept_greedy(
        run: _Run, draft: DraftResult, target_logprobs: torch.Tensor, score: ScoreResult
    ) -> _Verdict:
        rule, lenience = run.prepared.rule, run.prepared.request.lenience
        target_probs = target_logprobs.exp()
        accepted, replacements = greedy_verdict(
            rule, lenience, draft.tokens, draft.logprobs.exp(), target_probs
        )
        kept = _leading_true(accepted)
        replacement = int(replacements[kept]) if kept < len(draft.tokens) else None
        return _verdict(draft, kept, replacement, target_probs, score)

    @staticmethod
    def _accept_sampled(
        run: _Run, draft: DraftResult, target_logprobs: torch.Tensor, score: ScoreResult
    ) -> _Verdict:
        prepared = run.prepared
        rule, lenience, seed = prepared.rule, prepared.request.lenience, prepared.seed
        gamma = len(draft.tokens)
        positions = torch.arange(run.start + 1, run.start + 1 + gamma)  # of the drafts
        draft_probs, sampled_target, decision_draft, decision_target = _distributions(
            run, draft, target_logprobs, score
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
        kept = _leading_true(uniforms(seed, positions, "accept") < keep.double())
        replacement = None
        if kept < gamma:
            row = slice(kept, kept + 1)
            residual = residual_probs(
                rule,
                lenience,
                draft_probs[row],
                sampled_target[row],
                decision_draft[row],
                decision_target[row],
            )
            replacement = int(categorical(residual, seed, positions[row], "residual")[0])
        return _verdict(draft, kept, replacement, target_logprobs.exp(), score)

    @staticmethod
    def _accept_coupled(
        run: _Run, draft: DraftResult, target_logprobs: torch.Tensor, score: ScoreResult
    ) -> _Verdict:
        """Sampled drafts checked by coupling: at each draft position, the token a plain
        step would draw there — from the rule's target π, keyed by the position — is
        compared with the draft token; drafts are kept while they are equal, and the
        first draw that differs is the replacement. Every committed token is that draw,
        so the tokens are the very tokens of drawing from π without drafting (for the
        exact rule: non-speculative PoE with the same seed), whatever was drafted, and
        the rule is exact for any draft distribution q. For a point mass (n-gram drafts)
        it is also the best acceptance: d is kept with probability π(d) = min(1,
        π(d)/q(d)). For a full q (the draft model) it keeps d with probability π(d),
        less than min(1, π(d)/q(d)); only the automatic mode uses it there, so that its
        choice of drafter never changes a seeded request's tokens."""
        prepared = run.prepared
        gamma = len(draft.tokens)
        draft_probs, sampled_target, decision_draft, decision_target = _distributions(
            run, draft, target_logprobs, score
        )
        target = rule_target(
            prepared.rule,
            prepared.request.lenience,
            draft_probs,
            sampled_target,
            decision_draft,
            decision_target,
        )
        positions = torch.arange(run.start + 1, run.start + 1 + gamma)
        draws = categorical(target, prepared.seed, positions, "sample")
        kept = _leading_true(draws == draft.tokens)
        replacement = int(draws[kept]) if kept < gamma else None
        return _verdict(draft, kept, replacement, target_logprobs.exp(), score)

    # --- commit ----------------------------------------------------------------------

    def _commit(self, run: _Run, verdict: _Verdict) -> RoundOutput:
        tokens, finish = self._emit(run, verdict.tokens)
        drafted, accepted = verdict.drafted, verdict.accepted
        if len(tokens) < len(verdict.tokens):
            # Cut by a stop condition: only accepted draft tokens can precede the cut
            # (a replacement is always a round's last token), so the round decided on
            # exactly the positions it emitted.
            drafted = accepted = len(tokens)
        bonus = verdict.bonus and len(tokens) == len(verdict.tokens)
        run.stats.observe_round(drafted, accepted, bonus)
        run.rounds_by_drafter[verdict.drafter] = run.rounds_by_drafter.get(verdict.drafter, 0) + 1
        records = self._records(run, verdict, tokens)
        run.committed += tokens
        run.generated += tokens
        run.records += records
        run.round_sizes.append(len(tokens))
        if finish is None and len(run.generated) >= run.prepared.request.max_new_tokens:
            finish = FinishReason.LENGTH
        run.finish_reason = finish
        return RoundOutput(
            len(run.round_sizes) - 1,
            records,
            self._text_delta(run),
            finish,
            drafted,
            accepted,
            drafter=verdict.drafter,
        )

    def _emit(self, run: _Run, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Appends the round's text to `run.text`, token by token while a stop condition
        can cut the round; returns the tokens up to the cut and the finish reason."""
        request = run.prepared.request
        eos = () if request.ignore_eos else self.backend.info.eos_token_ids
        if not request.stop and not any(token in eos for token in tokens):
            run.text += run.detokenizer.push(tokens)
            return tokens, None
        longest_stop = max((len(stop) for stop in request.stop), default=0)
        for index, token in enumerate(tokens):
            checked_from = max(0, len(run.text) - longest_stop + 1)
            run.text += run.detokenizer.push([token])
            if token in eos:
                return tokens[: index + 1], FinishReason.EOS
            hits = [i for stop in request.stop if (i := run.text.find(stop, checked_from)) >= 0]
            if hits:
                run.text = run.text[: min(hits)]
                return tokens[: index + 1], FinishReason.STOP
        return tokens, None

    @staticmethod
    def _text_delta(run: _Run) -> str:
        """The text not yet handed out. Until the generation finishes, a tail that could
        be the start of a stop sequence is held back, so no text is sent that a later
        stop would cut."""
        if run.finish_reason is not None:
            if run.finish_reason != FinishReason.STOP:
                run.text += run.detokenizer.flush()
            end = len(run.text)
        else:
            end = len(run.text) - _stop_prefix_length(run.text, run.prepared.request.stop)
        delta, run.sent = run.text[run.sent : end], max(run.sent, end)
        return delta

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
        votes = verdict.votes[:rows]
        entropies = entropy(target).tolist()
        margins = stability_margin(target).tolist()
        radii = stability_radius(votes, torch.tensor(tokens)).tolist()
        vote_lists = votes.tolist()
        for i, record in enumerate(records):
            record.entropy, record.stability_margin = entropies[i], margins[i]
            record.stability_radius = radii[i]
            record.votes = dict(zip(verdict.voters, vote_lists[i], strict=True))
            if record.kind == TokenKind.REPLACEMENT:
                rejected = verdict.rejected
                record.rejected_token = rejected
                record.rejected_text = self.tokenizer.decode([rejected])
                record.validity_radius = validity_radius(vote_lists[i], rejected)
                record.suppression_score = float(
                    suppression_score(target[i : i + 1], torch.tensor([rejected]))[0]
                )
        return records

    def _output(self, run: _Run) -> GenerationOutput:
        prepared = run.prepared
        return GenerationOutput(
            text=run.text,
            token_ids=run.generated,
            tokens=run.records,
            finish_reason=run.finish_reason or FinishReason.LENGTH,
            stats={
                **run.stats.to_dict(),
                "prefilled_tokens": run.prefilled,
                "reused_tokens": run.reused,
                "resumed_rounds": run.resumed_rounds,
                "rounds_by_drafter": dict(run.rounds_by_drafter),
                "auto_inputs": (
                    run.auto.inputs(self.costs) if prepared.drafter == Drafter.AUTO else {}
                ),
            },
            seed=prepared.seed,
            draft_head=prepared.draft_head,
            jury=prepared.jury,
            prompt_tokens=len(prepared.prompt_tokens),
            rounds=run.round_sizes,
            session=run.session,
            beam_score=run.hypotheses[0].score if run.hypotheses else None,
            beams=self._beams(run) if prepared.request.return_beams else [],
            p_correct=run.judged.p_correct if run.judged else None,
            witness_head=run.judged.witness_head if run.judged else "",
        )

    def _beams(self, run: _Run) -> list[dict]:
        return [
            {
                "token_ids": list(hypothesis.tokens),
                "text": self.tokenizer.decode(list(hypothesis.tokens), skip_special_tokens=True),
                "score": hypothesis.score,
                "logprob": hypothesis.logprob,
            }
            for hypothesis in run.hypotheses
        ]


class Generation:
    """One request in progress: iterate it for its rounds; `close()` stops it early and
    frees its caches; `result()` is the whole output once the last round is out."""

    def __init__(self, engine: Engine, run: _Run) -> None:
        self._engine, self._run = engine, run
        self._rounds = engine._rounds(run)

    @property
    def session(self) -> str:
        return self._run.session

    @property
    def committed(self) -> list[int]:
        """Context and generated tokens so far."""
        return self._run.committed

    def progress(self) -> Progress:
        return self._run.progress()

    def __iter__(self) -> Iterator[RoundOutput]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()

    def result(self) -> GenerationOutput:
        if self._run.finish_reason is None:
            raise RuntimeError("the generation has not finished")
        return self._engine._output(self._run)


def _verdict(
    draft: DraftResult,
    kept: int,
    replacement: int | None,
    target_probs: torch.Tensor,
    score: ScoreResult,
) -> _Verdict:
    """The verdict of a speculative round: `kept` draft tokens, then the replacement."""
    draft_tokens = draft.tokens.tolist()
    tokens, kinds = draft_tokens[:kept], [TokenKind.DRAFT] * kept
    rejected = None
    if replacement is not None:
        tokens.append(replacement)
        kinds.append(TokenKind.REPLACEMENT)
        rejected = draft_tokens[kept]
    return _Verdict(
        tokens,
        kinds,
        len(draft_tokens),
        kept,
        target_probs,
        score.votes,
        score.voters,
        rejected,
    )


def _distributions(
    run: _Run, draft: DraftResult, target_logprobs: torch.Tensor, score: ScoreResult
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a sampled verdict decides on: the draft q and the target P as sampled
    (tempered, filtered), and the decision q and P the cascade rules defer on
    (temperature 1, unfiltered; the sampled ones when the round asked for none)."""
    draft_probs = draft.logprobs.exp()
    sampled_target = filter_logprobs(target_logprobs, run.prepared.sampling).exp()
    if draft.decision_logprobs is None:
        return draft_probs, sampled_target, draft_probs, sampled_target
    decision_draft = draft.decision_logprobs.exp()
    decision_target = normalise_logprobs(score.decision_log_product).exp()
    return draft_probs, sampled_target, decision_draft, decision_target


def _leading_true(mask: torch.Tensor) -> int:
    """Number of leading True values: [T, T, F, T] -> 2."""
    return int(mask.to(torch.int64).cumprod(0).sum())


def _stop_prefix_length(text: str, stops: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a stop
    sequence: "the ca" with stop "cat" → 2."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
