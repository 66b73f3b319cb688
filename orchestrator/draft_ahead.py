"""Pipelined rounds: the next round's draft sent ahead (`DraftAhead`), and whether sending
it pays (`AheadPolicy`).

When sending pays. Let D be a draft's seconds, S the jury's score of a round, and p the
chance that a round keeps every draft token. A draft sent ahead runs beside this round's
score:
- with probability p the next round uses it, which saves the overlap, min(S, D);
- otherwise it is discarded. The next round's own draft then waits for the discarded one
  to finish (a session has one trunk call at a time): max(D − S, 0) seconds more.

So a round sends ahead when p · min(S, D) > (1 − p) · max(D − S, 0). When D ≤ S a
discarded draft costs nothing, and sending always pays. Under the trained demo's heads
(p ≈ 0.4 at γ = 4, and a draft 3–4 times a score on a CPU), it does not pay.

D, S and p are measured per request, as decayed means over its last rounds (acceptance
comes in streaks). D is timed from sending to answer, whether the draft was sent ahead or
not; p counts the rounds that kept all their draft tokens. A request starts from what the
engine's earlier requests measured (`AheadPolicy.pooled`, a longer memory), and sends
nothing ahead until D and S have been measured.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from hydra_jury.orchestrator.backend import ModelShare
from hydra_jury.workers.calls import DraftCall, DraftResult

DECAY = 0.8  # per round: a request's last few rounds decide
POOLED_DECAY = 0.98  # per round: the engine's pooled measurements, over many requests
KEPT_ALL_PRIOR = (1.0, 2.0)  # rounds that kept every draft token, of rounds: 1 of 2


@dataclass
class DraftAhead:
    """The next round's draft, sent before this round's verdict."""

    call: DraftCall  # as the next round makes it if every draft token of this one is kept
    future: Future[tuple[DraftResult, ModelShare]]  # the result, and what it cost
    sent_at: float = field(default_factory=time.perf_counter)
    answered_at: float | None = None  # set when the future is done

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._answered)

    def _answered(self, _future: Future) -> None:
        self.answered_at = time.perf_counter()

    @property
    def seconds(self) -> float:
        """From sending to the answer, once the future is done (its callbacks run just
        after its waiters wake: until then, to now)."""
        answered = self.answered_at if self.answered_at is not None else time.perf_counter()
        return answered - self.sent_at


@dataclass
class AheadPolicy:
    """One request's measurements, and whether its next draft should go ahead; or, made
    by `pooled`, the engine's, which every request adds its rounds to."""

    draft_s: float | None = None
    score_s: float | None = None
    kept_all: float = KEPT_ALL_PRIOR[0]
    rounds: float = KEPT_ALL_PRIOR[1]
    decay: float = DECAY
    pool: AheadPolicy | None = None  # where this request's rounds are pooled
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def pooled(cls) -> AheadPolicy:
        return cls(decay=POOLED_DECAY)

    def starting(self) -> AheadPolicy:
        """A new request's policy: this pool's measurements, the full-acceptance counts
        scaled down to the prior's weight so that the request's own rounds soon decide."""
        with self._lock:
            weight = KEPT_ALL_PRIOR[1]
            return AheadPolicy(
                self.draft_s, self.score_s, self.kept_all_rate * weight, weight, pool=self
            )

    def observe_draft(self, seconds: float) -> None:
        with self._lock:
            self.draft_s = _decayed(self.draft_s, seconds, self.decay)
        if self.pool is not None:
            self.pool.observe_draft(seconds)

    def observe_score(self, seconds: float) -> None:
        with self._lock:
            self.score_s = _decayed(self.score_s, seconds, self.decay)
        if self.pool is not None:
            self.pool.observe_score(seconds)

    def observe_round(self, kept_all: bool) -> None:
        with self._lock:
            self.kept_all = self.decay * self.kept_all + kept_all
            self.rounds = self.decay * self.rounds + 1
        if self.pool is not None:
            self.pool.observe_round(kept_all)

    @property
    def kept_all_rate(self) -> float:
        return self.kept_all / self.rounds

    def pays(self) -> bool:
        """Whether sending the next draft ahead saves time on average (never before the
        draft and the score have been measured)."""
        if self.draft_s is None or self.score_s is None:
            return False
        p, draft, score = self.kept_all_rate, self.draft_s, self.score_s
        return p * min(score, draft) > (1 - p) * max(draft - score, 0.0)


def _decayed(mean: float | None, value: float, decay: float) -> float:
    return value if mean is None else decay * mean + (1 - decay) * value
