"""One round of the loop, up to its verdict: draft (a draft head, prompt lookup, the
draft model, or a beam search), score with the jury, verify (`poe.verify`). What the
round decided is committed by the engine.

Kinds of round
- head: γ draft tokens from the draft head (γ trunk steps), one jury call over them.
- one pass (n-gram or draft-model drafts): the trunk runs over the pending token and
  the k drafts at once, one jury call scores the k + 1 positions, and a bonus token is
  drawn when every draft is kept. With no draft it is a plain step.
- baselines: `verifier_only` is a plain step per token; `drafter_only` keeps the draft.
- auto: the automatic mode picks one of the above per round (`orchestrator.auto`).
- beam: a whole beam search as one round (`orchestrator.beam_search`).

Pipelined head rounds (a backend whose `draft_ahead` accepts): once a round's draft is
back, the next round's draft call is sent as that round would make it if every draft
token is kept (from the last draft token, γ positions on) while this round's jury
scores, when the request's measurements say it pays (`orchestrator.draft_ahead`). The
next round uses it when its own call is that one; otherwise (a rejection, a stop) it is
discarded, and the next call to the trunk starts at the committed position (the
position rule), so the trunk's cache never keeps a discarded draft. Draws are keyed
by position, so a draft sent ahead is the draft the next round would make: pipelining
never changes a token. Plain steps (`verifier_only`, and the automatic mode's rounds of
no draft) send the next step's trunk call as soon as their token is drawn. Every round
of the automatic mode chooses the next round as soon as its tokens are decided, and
sends the next round's trunk step then when that choice is a plain step; a plain step
after a round with drafts is pipelined too. No draft of the automatic mode is sent ahead.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError
from contextlib import nullcontext

import torch

from hydra_jury.orchestrator.auto import Choice, CostModel
from hydra_jury.orchestrator.backend import DecodingBackend
from hydra_jury.orchestrator.beam_search import BeamRun
from hydra_jury.orchestrator.draft_ahead import AheadPolicy, DraftAhead
from hydra_jury.orchestrator.output import TokenKind, Verdict
from hydra_jury.orchestrator.request import DrafterKind
from hydra_jury.orchestrator.run import Run
from hydra_jury.poe import (
    BeamSearch,
    Distributions,
    RequestStats,
    Rule,
    TargetRows,
    Verification,
    contrastive_logprobs,
    draw_token,
    filter_logprobs,
    normalise_logprobs,
    point_mass_logprobs,
    probabilities,
    reached_positions,
    target_rows,
    verify_coupled,
    verify_greedy,
    verify_sampled,
)
from hydra_jury.serving import tracing
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    ScoreCall,
    ScoreResult,
)


class Rounds:
    """Decides rounds over `backend`; `costs` is the automatic mode's cost model, shared
    by every request of the engine."""

    def __init__(self, backend: DecodingBackend, costs: CostModel) -> None:
        self.backend = backend
        self.costs = costs
        # What pipelined rounds measured, pooled over requests: a new one starts from it.
        self.ahead_pool = AheadPolicy.pooled()

    def decide(self, run: Run) -> Verdict:
        """Runs the round `run` is due and returns what it decided (nothing committed)."""
        prepared = run.prepared
        with run.timer.phase("draft_s") if run.ahead else nullcontext():
            ahead = self.settle(run)  # this round's draft, if the last round sent it
        remaining = prepared.request.max_new_tokens - len(run.progress.generated)
        if prepared.request.num_beams > 1:
            return self._beam_round(run, remaining)
        if prepared.drafter == DrafterKind.AUTO:
            return self._auto_round(run, remaining, ahead)
        # One-pass rounds commit up to k + 1 tokens: room for the bonus under the limit.
        if prepared.drafter == DrafterKind.NGRAM:
            return self._ngram_round(
                run, run.ngrams.draft(run.committed, min(prepared.gamma, remaining - 1))
            )
        if prepared.drafter == DrafterKind.MODEL:
            return self._model_round(run, min(prepared.gamma, remaining - 1), coupled=False)
        if prepared.rule == Rule.VERIFIER_ONLY:
            return self._plain_step(run, ahead, send_next=remaining > 1)
        if prepared.rule == Rule.DRAFTER_ONLY:
            return self._head_round(run, min(prepared.gamma, remaining))
        gamma = min(prepared.gamma, remaining)
        # What the next round drafts if this one keeps all γ: its draft can go ahead.
        next_gamma = min(prepared.gamma, remaining - gamma)
        return self._head_round(run, gamma, ahead, next_gamma)

    def settle(self, run: Run) -> DraftAhead | None:
        """Waits for the draft `run` sent ahead, if any, and takes it off the run: after
        this, the trunk holds no call of the session in flight. Returned done, or None
        when none was sent or it failed (a round that needs it makes the call itself,
        and meets the error there)."""
        ahead, run.ahead = run.ahead, None
        if ahead is None:
            return None
        try:
            failed = ahead.future.exception() is not None
        except CancelledError:  # the backend closed before it was sent
            failed = True
        return None if failed else ahead

    def _auto_round(self, run: Run, remaining: int, ahead: DraftAhead | None) -> Verdict:
        """The round the automatic mode chooses (`orchestrator.auto`), measured for the
        next choices. `ahead`: the plain step the last round sent, if it chose this
        round to be one."""
        with self.backend.sharing() as share:
            began = time.perf_counter()
            choice, verdict, kind, positions = self._chosen_round(run, remaining, ahead)
            cost = share.cost(time.perf_counter() - began)
        left = remaining - len(verdict.tokens)
        if left > 0:
            verdict.sent_ahead = self._plan_next(run, verdict.tokens, left)
        self.costs.observe(kind, positions, cost)
        reached = reached_positions(verdict.drafted, verdict.accepted)
        run.auto.observe(self.costs, choice, reached, verdict.accepted)
        return verdict

    def _chosen_round(
        self, run: Run, remaining: int, ahead: DraftAhead | None
    ) -> tuple[Choice, Verdict, DrafterKind, int]:
        """The round the automatic mode chooses, run: the choice, its verdict, and the
        kind and positions its cost is measured against. The choice was made by the
        last round, as soon as its tokens were known (`_plan_next`)."""
        choice, run.auto.planned = run.auto.planned, None
        if choice is None:
            choice, _ = self._choose(run, run.committed, remaining)
        if choice.drafter == DrafterKind.HEAD:
            verdict = self._head_round(run, choice.drafts)
            kind, positions = DrafterKind.HEAD, choice.drafts
        elif choice.drafter == DrafterKind.MODEL:
            # Coupled under sampling: every choice gives the tokens of a plain step.
            verdict = self._model_round(run, choice.drafts, coupled=True)
            kind, positions = DrafterKind.MODEL, choice.drafts
        elif choice.drafts:  # a one-pass round over the pending token and k n-gram drafts
            drafts = run.ngrams.draft(run.committed, choice.drafts)
            verdict = self._ngram_round(run, drafts, ahead)
            kind, positions = DrafterKind.NGRAM, choice.drafts + 1
        else:
            verdict = self._plain_step(run, ahead, send_next=False)
            kind, positions = DrafterKind.NGRAM, 1  # a one-pass round of no draft
        return choice, verdict, kind, positions

    def _choose(self, run: Run, committed: list[int], remaining: int) -> tuple[Choice, list[int]]:
        """The automatic mode's choice for a round after `committed`, with `remaining`
        tokens left to generate, and the prompt-lookup drafts it was offered (an n-gram
        choice of k drafts checks their first k)."""
        prepared = run.prepared
        offered, match = run.ngrams.lookup(committed, min(prepared.gamma, remaining - 1))
        head_cap = min(prepared.gamma, remaining) if prepared.draft_head else 0
        model_cap = min(prepared.gamma, remaining - 1) if self.backend.info.draft_model else 0
        greedy = prepared.sampling.greedy
        choice = run.auto.choose(self.costs, len(offered), head_cap, greedy, model_cap, match)
        return choice, offered

    def _plan_next(self, run: Run, tokens: list[int], remaining: int) -> bool:
        """Chooses the next round as soon as this one has decided its `tokens` (the
        choice needs nothing this round's commit adds; it reads the costs and acceptance
        counted up to the round before, as this round's are counted after the call has
        gone) and, when it is a plain step or a one-pass check of prompt-lookup drafts
        (known now), sends its trunk call ahead: under load it then joins the other
        sessions' batch while this round's metrics, commit and stream are done, as
        non-speculative decoding's steps do. (8 sessions
        of `serve`, trained demo checkpoint, float32, rounds nearly all plain, taken turn
        about with non-speculative decoding on one 2-core Intel server: chosen at each
        round, the automatic mode ran at 0.83-0.94x of it; chosen here and sent ahead,
        0.93-0.96x. Counting this round first kept the call waiting 76 µs (median; p90
        182 µs) after the token was drawn, against 12 µs in non-speculative decoding,
        and a session's longer stretch of Python is more often preempted under the
        interpreter lock: 16 sessions, 6 pairs each, 0.942x non-speculative PoE on
        average before, 0.973x after; 4 sessions 0.916x and 0.929x.) A stop condition
        that cuts `tokens` ends the generation, and what was sent is discarded. Whether
        the step was sent."""
        planned, offered = self._choose(run, [*run.committed, *tokens], remaining)
        run.auto.planned = planned
        if planned.drafter == DrafterKind.NONE:
            return self._send_ahead_from(run, tokens[-1], len(tokens), 1, trunk_only=True)
        if planned.drafter == DrafterKind.NGRAM:
            drafts = offered[: planned.drafts]
            return self._send_ahead_from(run, tokens[-1], len(tokens), 1, outside_drafts=drafts)
        return False

    def _beam_round(self, run: Run, remaining: int) -> Verdict:
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
            run.progress.stats,
            run.timer,
        )
        beams.search(run.committed, search)
        run.hypotheses = search.best()
        tokens = list(run.hypotheses[0].tokens)
        return Verdict(tokens, [TokenKind.BEAM] * len(tokens), 0, 0, DrafterKind.BEAM)

    def _head_round(
        self, run: Run, gamma: int, ahead: DraftAhead | None = None, next_gamma: int = 0
    ) -> Verdict:
        """γ draft tokens from the draft head (γ trunk steps), one jury call over them.
        `ahead`: a draft sent ahead by the last round, used if it is this round's;
        `next_gamma` > 0: the next round's draft may be sent ahead."""
        rule, policy = run.prepared.rule, run.ahead_policy
        call = self._draft_call(run, gamma, run.start, run.committed[-1])
        sent = self._taken(ahead, call)
        used_ahead = sent is not None
        began = time.perf_counter()
        draft = self._draft(run, call, sent)
        drafted = time.perf_counter()
        if rule == Rule.DRAFTER_ONLY:
            return self._keep_draft(draft)
        sent_ahead = next_gamma > 0 and policy.pays() and self._send_ahead(run, draft, next_gamma)
        sent = time.perf_counter()
        score = self._score(run, draft.hidden, draft.decision_logprobs is not None)
        scored = time.perf_counter()
        target = target_rows(score.log_product)  # [γ, V]
        verdict = self._verify(run, draft, target, score, DrafterKind.HEAD, coupled=False)
        verdict.sent_ahead, verdict.used_ahead = sent_ahead, used_ahead
        policy.observe_draft(ahead.seconds if used_ahead else drafted - began)
        policy.observe_score(scored - sent)
        policy.observe_round(kept_all=verdict.accepted == len(draft.tokens))
        return verdict

    def _plain_step(self, run: Run, ahead: DraftAhead | None, send_next: bool) -> Verdict:
        """A plain step (`verifier_only`, or the automatic mode's round of no draft): one
        trunk step and one jury call, no draft; a token drawn from the target. `ahead`:
        the step sent ahead by the last round, used if it is this one's. With
        `send_next`, the next step's trunk call, which needs only this token, is sent as
        soon as the token is drawn: it runs while this round's metrics, commit and stream
        are done (where the backend batches sessions, beside theirs; never discarded but
        at the end)."""
        call = self._draft_call(run, 1, run.start, run.committed[-1], trunk_only=True)
        sent = self._taken(ahead, call)
        draft = self._draft(run, call, sent)
        score = self._score(run, draft.hidden, with_decision=False)
        verdict = self._sample_target(run, target_rows(score.log_product), score)
        verdict.sent_ahead = send_next and self._send_ahead_from(
            run, verdict.tokens[-1], 1, 1, trunk_only=True
        )
        verdict.used_ahead = sent is not None
        return verdict

    def _taken(self, ahead: DraftAhead | None, call: DraftCall) -> DraftResult | None:
        """The result of the call the last round sent `ahead` when it is this round's
        `call`, counted as this round's cost; else None (the round makes its call)."""
        if ahead is None or ahead.call != call:
            return None
        draft, share = ahead.future.result()
        self.backend.count_ahead(share)
        return draft

    def _send_ahead(self, run: Run, draft: DraftResult, gamma: int) -> bool:
        """Sends the draft the next round makes if every token of `draft` is kept: from
        its last token, at the position after them. Whether the backend took it."""
        tokens = draft.tokens.tolist()
        return self._send_ahead_from(run, tokens[-1], len(tokens), gamma)

    def _send_ahead_from(
        self,
        run: Run,
        token: int,
        emitted: int,
        gamma: int,
        trunk_only: bool = False,
        outside_drafts: list[int] | None = None,
    ) -> bool:
        """Sends the draft call of the round after this one, if this one emits `emitted`
        tokens ending with `token` (`trunk_only`: a plain step's; `outside_drafts`: a
        one-pass check's). Whether the backend took it."""
        if not self.backend.pipelines:
            return False
        start = run.start + emitted
        call = self._draft_call(
            run, gamma, start, token, trunk_only=trunk_only, outside_drafts=outside_drafts
        )
        future = self.backend.draft_ahead(call)
        if future is None:
            return False
        run.ahead = DraftAhead(call, future)
        return True

    def _draft_call(
        self,
        run: Run,
        gamma: int,
        start: int,
        pending: int,
        draft_model: bool = False,
        trunk_only: bool = False,
        outside_drafts: list[int] | None = None,
    ) -> DraftCall:
        """The draft call of a round starting at `start` from the token `pending`;
        `trunk_only`: a plain step's (the trunk alone, nothing drawn); `outside_drafts`:
        a one-pass round's (the trunk alone, over `pending` and these drafts)."""
        prepared = run.prepared
        trunk_only = trunk_only or outside_drafts is not None or prepared.rule == Rule.VERIFIER_ONLY
        return DraftCall(
            run.session,
            start,
            pending,
            gamma,
            None if trunk_only or draft_model else prepared.draft_head,
            prepared.sampling,
            prepared.seed,
            with_decision=_decides_apart(run) and not trunk_only,
            draft_model=draft_model,
            outside_drafts=tuple(outside_drafts or ()),
        )

    def _draft(self, run: Run, call: DraftCall, done: DraftResult | None = None) -> DraftResult:
        """The result of `call`: `done` when it was sent ahead, else asked for now."""
        if done is None:
            with run.timer.phase("draft_s"):
                done = self.backend.draft(call)
        _count_work(run.progress.stats, done.trunk_steps, done.head_evaluations)
        return done

    def _ngram_round(self, run: Run, drafts: list[int], ahead: DraftAhead | None = None) -> Verdict:
        """Prompt-lookup drafts (point masses), checked in one pass; the trunk step over
        the pending token and the k drafts (a draft call of outside drafts, which a
        server batches with the other sessions' plain steps) is this round's only trunk
        call, or the one the last round sent `ahead` if it is this one. No draft: a plain
        step."""
        call = self._draft_call(run, 1, run.start, run.committed[-1], outside_drafts=drafts)
        sent = self._taken(ahead, call)
        hidden = self._draft(run, call, sent).hidden
        draft_tokens = torch.tensor(drafts, dtype=torch.long)
        point_mass = point_mass_logprobs(draft_tokens, self.backend.info.vocab_size)
        decision = point_mass if _decides_apart(run) else None
        draft = DraftResult(draft_tokens, point_mass, decision, hidden)
        verdict = self._check_in_one_pass(run, draft, DrafterKind.NGRAM, coupled=True)
        verdict.used_ahead = sent is not None
        return verdict

    def _model_round(self, run: Run, gamma: int, *, coupled: bool) -> Verdict:
        """γ drafts from the trunk service's draft model, which then runs the trunk over
        the pending token and the drafts in the same call; checked in one pass. With
        `coupled`, sampled drafts are kept only where a plain step would draw them."""
        if gamma == 0:  # no room for a draft under the token limit: a plain step
            return self._ngram_round(run, [])
        call = self._draft_call(run, gamma, run.start, run.committed[-1], draft_model=True)
        draft = self._draft(run, call)
        return self._check_in_one_pass(run, draft, DrafterKind.MODEL, coupled)

    def _check_in_one_pass(
        self, run: Run, draft: DraftResult, drafter: DrafterKind, coupled: bool
    ) -> Verdict:
        """Outside draft tokens checked in one pass: `draft.hidden` holds the trunk
        outputs of the pending token and the k drafts (k+1 positions); one jury call
        scores them, acceptance runs left to right and — when all k are kept — a bonus
        token is drawn from the target at the last position. No draft: a plain step that
        samples from the target."""
        score = self._score(run, draft.hidden, draft.decision_logprobs is not None)
        target = target_rows(score.log_product)  # [k + 1, V]
        k = len(draft.tokens)
        if k == 0:
            return self._sample_target(run, target, score)
        # Every row's target, the bonus's too, is kept for the metrics.
        verdict = self._verify(run, draft, target, score, drafter, coupled)
        if verdict.accepted == k:
            bonus = self._draw(run, target.logprobs[k:], run.start + 1 + k, target.probs[k:])
            verdict.tokens.append(bonus)
            verdict.kinds.append(TokenKind.BONUS)
            verdict.bonus = True
        return verdict

    def _draw(
        self, run: Run, logprobs: torch.Tensor, position: int, probs: torch.Tensor | None = None
    ) -> int:
        """The token at `position` from the target row `logprobs` [1, V] (`probs`: its
        probabilities, where the round has them)."""
        prepared = run.prepared
        sampling, seed = prepared.sampling, prepared.seed
        return draw_token(logprobs, sampling, seed, position, "sample", probs)[0]

    def _score(self, run: Run, hidden: HiddenStates, with_decision: bool) -> ScoreResult:
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
        with run.timer.phase("score_s"):
            score = self.backend.score(call)
        _count_work(run.progress.stats, 0, score.head_evaluations)
        return score

    @staticmethod
    def _keep_draft(draft: DraftResult) -> Verdict:
        """drafter_only: every draft token is kept; no jury, no metrics."""
        gamma = len(draft.tokens)
        kinds = [TokenKind.DRAFT] * gamma
        return Verdict(draft.tokens.tolist(), kinds, gamma, gamma, DrafterKind.HEAD)

    @tracing.spanned("accept")
    def _sample_target(self, run: Run, target: TargetRows, score: ScoreResult) -> Verdict:
        """A plain step: one token from the target (or, contrastive, from the contrastive
        distribution of the target and the amateur), nothing drafted."""
        prepared = run.prepared
        chosen_from = target.logprobs
        if prepared.amateur is not None:
            alpha = prepared.request.contrastive_alpha
            chosen_from = contrastive_logprobs(target.logprobs, score.amateur_logprobs, alpha)
        if chosen_from is not target.logprobs:
            token = self._draw(run, chosen_from, run.start + 1)
        elif prepared.sampling.greedy:
            token = target.greedy.tolist()[0]  # the draw's greedy choice, made with the rows
        else:
            token = self._draw(run, chosen_from, run.start + 1, target.probs)
        return Verdict(
            [token],
            [TokenKind.SAMPLE],
            0,
            0,
            DrafterKind.NONE,
            target,
            score.votes,
            score.voters,
        )

    @staticmethod
    @tracing.spanned("accept")
    def _verify(
        run: Run,
        draft: DraftResult,
        target: TargetRows,
        score: ScoreResult,
        drafter: DrafterKind,
        coupled: bool,
    ) -> Verdict:
        """The k draft tokens checked against the target's first k rows:
        greedy, by coupling (`coupled`: outside drafts, whose kept tokens are then the
        draws of a plain step — for the draft model, the automatic mode's choice so that
        it never changes a seeded request's tokens), else by speculative sampling."""
        prepared = run.prepared
        rule, lenience, seed = prepared.rule, prepared.request.lenience, prepared.seed
        k = len(draft.tokens)
        probs = _distributions(run, draft, target.logprobs[:k], target.probs[:k], score)
        positions = torch.arange(run.start + 1, run.start + 1 + k)  # of the drafts
        if prepared.sampling.greedy:
            verification = verify_greedy(rule, lenience, draft.tokens, probs)
        elif coupled and rule != Rule.LENIENT:  # lenient keeps more than π(d)
            verification = verify_coupled(rule, lenience, draft.tokens, probs, seed, positions)
        else:
            verification = verify_sampled(rule, lenience, draft.tokens, probs, seed, positions)
        return _verdict(draft, verification, target, score, drafter)


def _decides_apart(run: Run) -> bool:
    """Whether the round needs decision distributions of its own: cascade rules decide
    with temperature-1, unfiltered distributions (greedy reads those anyway)."""
    return run.prepared.rule.is_cascade and not run.prepared.sampling.greedy


def _count_work(stats: RequestStats, trunk_steps: int, head_evaluations: int) -> None:
    stats.trunk_steps += trunk_steps
    stats.head_evaluations += head_evaluations


def _distributions(
    run: Run,
    draft: DraftResult,
    target_logprobs: torch.Tensor,
    target_probs: torch.Tensor,
    score: ScoreResult,
) -> Distributions:
    """What a verdict decides on: the draft q and the target P as sampled (tempered,
    filtered), and the decision q and P the cascade rules defer on (temperature 1,
    unfiltered; the sampled ones when the round asked for none). Greedy reads the
    decision ones: the unfiltered draft and target (`target_probs`, the probabilities of
    `target_logprobs`)."""
    draft_probs = probabilities(draft.logprobs)
    if run.prepared.sampling.greedy:
        return Distributions(draft_probs, target_probs)
    sampled_target = probabilities(filter_logprobs(target_logprobs, run.prepared.sampling))
    if draft.decision_logprobs is None:
        return Distributions(draft_probs, sampled_target)
    rows = len(draft.tokens)
    decision_target = probabilities(normalise_logprobs(score.decision_log_product[:rows]))
    return Distributions(
        draft_probs, sampled_target, probabilities(draft.decision_logprobs), decision_target
    )


def _verdict(
    draft: DraftResult,
    verification: Verification,
    target: TargetRows,
    score: ScoreResult,
    drafter: DrafterKind,
) -> Verdict:
    """The verdict of a speculative round: the kept draft tokens, then the replacement."""
    draft_tokens = draft.tokens.tolist()
    kept = verification.accepted
    tokens, kinds = draft_tokens[:kept], [TokenKind.DRAFT] * kept
    rejected = None
    if verification.replacement is not None:
        tokens.append(verification.replacement)
        kinds.append(TokenKind.REPLACEMENT)
        rejected = draft_tokens[kept]
    return Verdict(
        tokens,
        kinds,
        len(draft_tokens),
        kept,
        drafter,
        target,
        score.votes,
        score.voters,
        rejected,
    )
