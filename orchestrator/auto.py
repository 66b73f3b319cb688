"""The automatic mode: before each round the server chooses whether to speculate, with
which drafter and how far, to maximise the expected tokens per second.

Inputs
- costs (shared by every request of the engine, measured): seconds of a one-pass round
  against the positions it verifies (the pending token and k drafts: a trunk forward and
  a jury call over k + 1 positions), of a head-drafted round against γ (γ trunk and
  draft-head steps, a jury call over γ positions), and of a draft-model round against γ
  (γ draft-model steps, then a one-pass check of γ + 1 positions). Each is a line
  fitted by exponentially decayed least squares over recent rounds, so it follows the
  machine, and kept per load (the requests running, in levels: `load_level`): a load
  met for the first time measures its one-pass rounds at two sizes before it drafts
  from them; until a drafted kind has been measured at two sizes its line is a prior
  scaled from what is known.
- load (where sessions' calls are batched: `serve`, and the services of the split
  stack, which tell each call's share in `Timings.share_ns`): a round is measured by
  what it costs the server's throughput, not by its wall time — its share of the
  batches its calls ran in plus its own work (`backend.ModelShare`): each batch's fixed
  cost divided among its calls, and what the round's own positions add to the batch,
  which every call of it waits for (`serving.cost_line.batch_shares`). With many
  sessions the fixed cost is spread thin and a verified position costs about what a
  whole plain step's share does, so drafts that are mostly rejected stop paying and the
  mode stops speculating; alone, the share is the round's time and nothing changes.
- acceptance (measured): how often a draft token is kept, per drafter (prompt lookup's
  per length of the suffix its drafts continue: its one-token matches draft far worse
  than its longer ones, and under load only the longer ones pay) — decayed counts
  over the request's rounds, starting from the engine's pooled counts over earlier
  requests (how well a head or a draft model drafts is mostly a property of the
  models), or from a prior before any.

Expected tokens of a round with acceptance α: a one-pass round with k drafts (n-gram or
draft model) commits (1 − α^(k+1)) / (1 − α) tokens (the replacement or the bonus
included), a head round with γ drafts (1 − α^γ) / (1 − α), a plain step 1. The choice
is the largest expected tokens over predicted seconds.

Head drafts are candidates under greedy decoding only. There every choice gives the
same tokens; under sampling the candidates are n-gram and draft-model drafts and plain
steps, which (by the coupling of `poe.verify_coupled`) give the tokens of
non-speculative sampling. So with the exact rule the automatic mode changes the speed,
never the output.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from hydra_jury.orchestrator.request import DrafterKind
from hydra_jury.poe.drafting import NGRAM_MAX, NGRAM_MIN
from hydra_jury.serving.cost_line import LinearCost

HEAD, MODEL, NGRAM, NONE = DrafterKind.HEAD, DrafterKind.MODEL, DrafterKind.NGRAM, DrafterKind.NONE

# Until measured: a head-drafted round of γ costs this many plain steps per draft token
# (a trunk step and a draft-head step each) plus one jury call.
HEAD_STEP_PRIOR = 0.6
VERIFY_POSITION_PRIOR = 0.05  # an extra verified position, in plain steps (batched)
MODEL_STEP_PRIOR = 0.3  # a draft-model step, in plain steps (a smaller model)


def acceptance_key(drafter: DrafterKind, match: int = NGRAM_MIN) -> str:
    """Whose acceptance a round's drafts count to: its drafter's, and for prompt lookup
    that of the length of the suffix its drafts continue (`NgramIndex.lookup`)."""
    return f"{drafter}{match}" if drafter == NGRAM else str(drafter)


# Per position, until measured. Prompt lookup's by the length of its match, from the demo
# checkpoint's model-written answers (a draft's first token kept after 11%, 37% and 47%
# of one-, two- and three-token matches; 0.18, 0.63 and 0.90 of its 4 tokens on average).
PRIOR_ACCEPTANCE = {
    **{
        acceptance_key(NGRAM, n): rate
        for n, rate in zip(range(NGRAM_MIN, NGRAM_MAX + 1), (0.15, 0.4, 0.5), strict=True)
    },
    acceptance_key(HEAD): 0.7,
    acceptance_key(MODEL): 0.5,
}
PRIOR_WEIGHT = 2.0  # pseudo-positions behind the acceptance prior
COST_DECAY = 0.95  # per round of each request running: recent rounds' costs count more
ACCEPTANCE_DECAY = 0.9  # per round: recent rounds count more
# Each kind of round is measured whatever it is predicted to cost once every this many
# rounds of each request running (of the engine's rounds, EXPLORE_EVERY times the
# requests running), first at these rounds.
EXPLORE_EVERY = 16
EXPLORE_AT = {NGRAM: 4, HEAD: 8, MODEL: 12}
# Each measuring round of a kind that is not then chosen on its merit doubles the wait
# for the next, up to this many times EXPLORE_EVERY (`CostModel.explores`).
EXPLORE_BACKOFF = 8


def load_level(running: int) -> int:
    """The load a round's cost is kept under: log2 of the requests running, rounded (1;
    2; 3-5; 6-11; 12-22; ...), so that a closed loop of 2, 4, 8 or 16 sessions, its
    count dipping by one between a request and the next, stays at one level."""
    return round(math.log2(max(1, running)))


class CostModel:
    """What an engine's requests measure for each other: the costs of the three kinds
    of rounds, keyed by their drafter (NGRAM: every one-pass round, a plain step
    included; HEAD; MODEL) and by the load they ran under (`load_level`), and the
    acceptance of each drafter pooled over requests (`acceptance_key`).

    Costs are kept per load because under load a round is priced by its share of the
    batches it joins, and what a verified position adds to a batch of many sessions is
    many times what it adds to one: one line over every load fits a slope across loads.
    (`serve`, 8 sessions after 1, side by side with non-speculative PoE, one line: the
    rounds measured alone and the plain steps measured under load made prompt lookup
    look cheap, chosen in 9.3% of the 8-session rounds and 0.87x the tokens/s.)"""

    def __init__(self) -> None:
        self.levels: dict[int, dict[DrafterKind, LinearCost]] = {}  # per `load_level`
        self.acceptance = {key: Acceptance.prior(key) for key in PRIOR_ACCEPTANCE}
        self.rounds = 0  # the automatic rounds of every request
        # The round each kind was last measured at (as if 16 rounds before its first).
        self._explored = {kind: at - EXPLORE_EVERY for kind, at in EXPLORE_AT.items()}
        self._backoff = dict.fromkeys(EXPLORE_AT, 1)  # the wait's multiple, per kind
        self._explored_running = dict.fromkeys(EXPLORE_AT, 1)  # the requests running then
        self._active = 0  # the engine's requests running now (`started`, `ended`)
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        """The engine's requests running now."""
        return self._active

    @property
    def running(self) -> int:
        """The requests running, at least one (the one asking)."""
        return max(1, self._active)

    @property
    def lines(self) -> dict[DrafterKind, LinearCost]:
        """The cost lines of the load the engine runs under now."""
        level = load_level(self.running)
        lines = self.levels.get(level)
        if lines is None:
            lines = {kind: LinearCost(COST_DECAY) for kind in (NGRAM, HEAD, MODEL)}
            self.levels[level] = lines
        return lines

    @property
    def one_pass(self) -> LinearCost:
        return self.lines[NGRAM]

    def started(self) -> None:
        """A request of the engine starts running (any mode: all share its batches)."""
        with self._lock:
            self._active += 1

    def ended(self) -> None:
        with self._lock:
            self._active -= 1

    def observe(self, kind: DrafterKind, positions: int, seconds: float) -> None:
        """A round's cost, under the load now. The lines forget at COST_DECAY per round
        of each request running: with n requests, every one of their rounds decays the
        earlier ones by COST_DECAY^(1/n), so a line remembers as many rounds of each
        request as it does of one alone. (With a decay per round whatever the load, 8
        sessions fitted each line over their last two or three rounds each, and its
        slope followed the one or two rounds with drafts among them.)"""
        with self._lock:
            decay = COST_DECAY ** (1 / self.running)
            self.lines[kind].observe(positions, seconds, decay)

    def count_round(self) -> None:
        """An automatic round is done."""
        with self._lock:
            self.rounds += 1

    def explores(self, kind: DrafterKind) -> bool:
        """Whether this round measures `kind` whatever it is predicted to cost: one
        round in EXPLORE_EVERY per request running, whichever request makes it. Under
        load a round of many drafts costs the other sessions every position it
        verifies, so the engine measures as often with 16 sessions as with one (each
        request measuring every 16 of its rounds: 0.76x the non-speculative tokens/s
        with 16 sessions of `serve`; every 16 of the engine's: 0.84x).

        A kind that is still not chosen on its merit after a measuring round is
        measured half as often again, down to once in EXPLORE_BACKOFF times the period:
        where speculation does not pay, each measuring round is a loss. (4 sessions of
        `serve`, trained demo, T = 0.8, closed loop, 2-core Intel, the mode kept from
        choosing drafts on merit, 8 pairs: 6-8 measuring rounds a run and 0.954x the
        non-speculative tokens/s at a fixed period, 1-2 and 0.983x backing off.) A
        choice on merit (`chosen`) restores the period, and so does a load that has
        fallen below half of what it was at the last measurement: what was measured
        then is stale."""
        with self._lock:
            running = self.running
            if running * 2 <= self._explored_running[kind]:
                self._backoff[kind] = 1
            every = EXPLORE_EVERY * running * self._backoff[kind]
            if self.rounds - self._explored[kind] < every:
                return False
            self._explored[kind] = self.rounds
            self._explored_running[kind] = running
            self._backoff[kind] = min(2 * self._backoff[kind], EXPLORE_BACKOFF)
            return True

    def measured_drafts(self, offered: int) -> int:
        """How many of the `offered` drafts a measuring round checks: all of them for
        one request running, 1 / n of them (at least one) with n running. Under load a
        measuring round's positions join a batch the other sessions wait for: 8 sessions
        of `serve`, open prompts, T = 0.8, a measuring round of prompt lookup's 8
        drafts made its Draft and Score batches 16 rows instead of 8, 42-68 and 53-58 ms
        against 30; with one draft, 9 rows, 31-46 ms. Side by side (`bench_serving.py
        --repeats 4`, 2-core AMD EPYC), the automatic mode went from 0.87x (0.83-0.93)
        non-speculative PoE's tokens/s to 0.98x (0.94-0.99). One draft still gives the
        line a second size and the acceptance a first position, as the model has one rate
        for every position."""
        with self._lock:
            return max(1, offered // self.running)

    def chosen(self, kind: DrafterKind) -> None:
        """A round of `kind` was chosen on its merit: it is measured at the full rate."""
        with self._lock:
            self._backoff[kind] = 1

    def observe_acceptance(self, key: str, reached: int, kept: int) -> None:
        with self._lock:
            self.acceptance[key].observe(reached, kept)

    def starting_acceptance(self) -> dict[str, Acceptance]:
        """A new request's acceptance counts: the pooled ones, scaled down to the prior's
        weight so that the request's own rounds soon dominate."""
        with self._lock:
            return {
                key: Acceptance(counts.rate * PRIOR_WEIGHT, PRIOR_WEIGHT)
                for key, counts in self.acceptance.items()
            }

    def known(self, kind: DrafterKind) -> bool:
        """Whether `kind` was measured under the load now."""
        with self._lock:
            return self.lines[kind].known

    def fitted(self, kind: DrafterKind) -> bool:
        """Whether `kind` was measured at two sizes under the load now: its line is its own."""
        with self._lock:
            return self.lines[kind].line() is not None

    def predict(self, kind: DrafterKind, positions: int) -> float:
        """Predicted seconds of a round (relative units before any measurement)."""
        fixed, per_position = self.predictions()[kind]
        return fixed + per_position * positions

    def predictions(self) -> dict[DrafterKind, tuple[float, float]]:
        """Each kind's predicted seconds of a round as a line against its positions,
        (fixed, per position), taken together: a choice reads them under one lock, as
        it is made between a round's token and the next step's call."""
        with self._lock:
            plain = self.one_pass.mean() if self.one_pass.known else 1.0
            return {kind: self._prediction(kind, plain) for kind in self.lines}

    def _prediction(self, kind: DrafterKind, plain: float) -> tuple[float, float]:
        cost = self.lines[kind]
        line = cost.line()
        if line is not None:
            return line
        if kind == NGRAM:  # plain · (1 + prior · (positions − 1))
            return plain * (1 - VERIFY_POSITION_PRIOR), plain * VERIFY_POSITION_PRIOR
        # A drafted round: γ steps of its drafter and a jury call.
        step = HEAD_STEP_PRIOR if kind == HEAD else MODEL_STEP_PRIOR
        if cost.known:  # one size seen: scaled by γ, cost · (0.5 + step · γ) / (0.5 + step · seen)
            scale = cost.mean() / (0.5 + step * max(cost.sizes))
            return 0.5 * scale, step * scale
        return plain, plain * step


@dataclass
class Acceptance:
    """Decayed counts of drafts reached and kept, for one drafter (`acceptance_key`), from
    a prior."""

    kept: float
    reached: float

    @classmethod
    def prior(cls, key: str) -> Acceptance:
        return cls(PRIOR_ACCEPTANCE[key] * PRIOR_WEIGHT, PRIOR_WEIGHT)

    def observe(self, reached: int, kept: int) -> None:
        self.kept = ACCEPTANCE_DECAY * self.kept + kept
        self.reached = ACCEPTANCE_DECAY * self.reached + reached

    @property
    def rate(self) -> float:
        return min(self.kept / self.reached, 0.999)


def expected_tokens(acceptance: float, drafts: int, bonus: bool) -> float:
    """Tokens a round commits on average: drafts kept left to right, then one more
    (a replacement, or the bonus when every draft was kept and `bonus`)."""
    steps = drafts + 1 if bonus else drafts
    return (1 - acceptance**steps) / (1 - acceptance)


@dataclass(frozen=True)
class Choice:
    drafter: DrafterKind  # NONE (a plain step), NGRAM, HEAD or MODEL
    drafts: int  # k n-gram drafts, or γ head or draft-model drafts
    match: int = NGRAM_MIN  # NGRAM: the length of the suffix its drafts continue

    @property
    def acceptance_key(self) -> str:
        return acceptance_key(self.drafter, self.match)


@dataclass
class AutoState:
    """One request's side of the automatic mode."""

    acceptance: dict[str, Acceptance] = field(
        default_factory=lambda: {key: Acceptance.prior(key) for key in PRIOR_ACCEPTANCE}
    )
    planned: Choice | None = None  # the next round's choice, made as the last one ended

    @classmethod
    def starting(cls, costs: CostModel) -> AutoState:
        return cls(costs.starting_acceptance())

    def choose(
        self,
        costs: CostModel,
        ngram_drafts: int,
        head_cap: int,
        greedy: bool,
        model_cap: int = 0,
        ngram_match: int = NGRAM_MIN,
    ) -> Choice:
        """The best round: `ngram_drafts` tokens are on offer from prompt lookup,
        continuing a suffix of `ngram_match` tokens; head drafts (greedy only) up to
        `head_cap`; draft-model drafts up to `model_cap` (0: no draft model)."""
        head_cap = head_cap if greedy else 0
        if not (ngram_drafts or head_cap > 0 or model_cap > 0):
            # Nothing on offer: a plain step, chosen without reading the costs. Most
            # rounds are this under sampling, and the choice is made between a token
            # and the next step's call: reading the costs took 36 of the 76 µs between
            # them (median, in-process, trained demo, 2-core Intel Xeon); 7.5 µs now.
            return Choice(NONE, 0)
        measuring = Choice(NGRAM, costs.measured_drafts(ngram_drafts), ngram_match)
        if not costs.known(NGRAM) or (ngram_drafts and not costs.fitted(NGRAM)):
            # Every other cost is predicted against a one-pass round (a plain step is
            # one): measure that first under each load, at two sizes, or the
            # predictions mix units, and a verified position is priced by a prior.
            return measuring if ngram_drafts else Choice(NONE, 0)
        if ngram_drafts and costs.explores(NGRAM):  # and now and then
            return measuring
        predicted = costs.predictions()

        def seconds(kind: DrafterKind, positions: int) -> float:
            fixed, per_position = predicted[kind]
            return fixed + per_position * positions

        best, best_rate = Choice(NONE, 0), 1.0 / seconds(NGRAM, 1)
        alpha = self.acceptance[measuring.acceptance_key].rate if ngram_drafts else 0.0
        for k in range(1, ngram_drafts + 1):
            rate = expected_tokens(alpha, k, bonus=True) / seconds(NGRAM, k + 1)
            if rate > best_rate:
                best, best_rate = Choice(NGRAM, k, ngram_match), rate
        # (drafter, the most it may draft, whether its rounds end with a bonus token)
        drafted = [(HEAD, head_cap, False), (MODEL, model_cap, True)]
        for drafter, cap, bonus in drafted:
            if cap <= 0:
                continue
            if not costs.known(drafter) or costs.explores(drafter):
                return Choice(drafter, costs.measured_drafts(cap))  # measure it now and then
            alpha = self.acceptance[acceptance_key(drafter)].rate
            for gamma in range(1, cap + 1):
                rate = expected_tokens(alpha, gamma, bonus) / seconds(drafter, gamma)
                if rate > best_rate:
                    best, best_rate = Choice(drafter, gamma), rate
        if best.drafter != NONE:
            costs.chosen(best.drafter)
        return best

    def observe(self, costs: CostModel, choice: Choice, reached: int, kept: int) -> None:
        costs.count_round()
        if choice.drafter != NONE:
            self.acceptance[choice.acceptance_key].observe(reached, kept)
            costs.observe_acceptance(choice.acceptance_key, reached, kept)

    def inputs(self, costs: CostModel) -> dict[str, float]:
        """What the choices are made from, for the request's statistics."""
        return {
            **{f"{key}_acceptance": counts.rate for key, counts in self.acceptance.items()},
            "plain_step_s": costs.predict(NGRAM, 1),
            "verify_position_s": costs.predict(NGRAM, 2) - costs.predict(NGRAM, 1),
            "head_round_4_s": costs.predict(HEAD, 4),
            "model_round_4_s": costs.predict(MODEL, 4),
        }
