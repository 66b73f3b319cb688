"""One session's plain steps run back to back on the model thread of the single-process
server: a step's trunk forward, the jury's score of its position and the draw of its
token in one batch, and the next step queued at once from that token.

Without it, a plain step is two calls of the session's own thread (Draft, then Score)
and the token is drawn there: between two batches the model thread waits while every
session's thread, one at a time under the interpreter lock, takes its result, draws and
sends its next call (8 sessions of `serve`, 2-core AMD EPYC: 2-3 ms after each Draft
batch and 7-8 ms after each Score batch, against 1-2 ms for one session). A chain is one
call of the Draft batcher that answers `CONTINUE` after each step, so the batcher runs
it again in the next batch without a queue or a batch window, and the session's thread
only takes the steps' results, in order, and commits and streams them.

The token is `poe.plain_step_token` of the step's target rows, the draw the session's
thread makes itself otherwise: a chain never changes a token. A chain stops by itself
after its last allowed step, at a stop token, or when the session has fallen
`MAX_UNTAKEN` steps behind (a slow stream: the steps are not run far ahead of what
can be sent); the session stops it (`stop`) when the generation ends otherwise or
needs the trunk for a call of its own, and waits for its end (`ended`) before that
call: the trunk holds one call of a session at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from hydra_jury.poe import SamplingParams, TargetRows, plain_step_token, target_rows
from hydra_jury.workers.calls import DraftCall, DraftResult, HiddenStates, ScoreCall, ScoreResult

MAX_UNTAKEN = 2  # steps run and not yet taken by the session, at most


@dataclass(frozen=True)
class PlainStep:
    """One step's results, on the host, and the token drawn from them."""

    draft: DraftResult
    score: ScoreResult
    target: TargetRows
    token: int
    seconds: float  # the batch the step ran in, from its start to this step's draw
    share: float  # of which this step's part: the batch's time over its calls


@dataclass(frozen=True)
class ChainScoring:
    """What each step's score call and draw take beside its position and hidden states."""

    jury: tuple[str, ...]
    temperature: float
    beta: float
    sampling: SamplingParams
    seed: int
    amateur: str | None = None
    contrastive_alpha: float = 0.0


class PlainChain:
    """A session's chain of plain steps: the Draft batcher's ticket (`session`,
    `trunk_tokens`) and the steps' results, one future per step in order."""

    def __init__(
        self, call: DraftCall, scoring: ChainScoring, steps: int, stop_tokens: frozenset[int]
    ) -> None:
        """`call`: the first step's trunk call (a plain step's); at most `steps` steps,
        none after a token of `stop_tokens`."""
        if call.draft_head is not None or call.draft_model or call.outside_drafts:
            raise ValueError("a chain runs plain steps only")
        if steps < 1:
            raise ValueError(f"a chain runs at least one step, got {steps}")
        self.session = call.session
        self.call = call  # the next step's
        self.scoring = scoring
        self._steps_left = steps
        self._stop_tokens = stop_tokens
        self._lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None  # what ended the chain, if it failed
        self._published = 0  # steps run
        self._taken = 0  # steps the session has taken
        self._futures: dict[int, Future[PlainStep | None]] = {}
        self.ended: Future | None = None  # the batcher's future of the chain, once sent

    @property
    def trunk_tokens(self) -> list[int]:
        """The positions a step runs, for the batcher's token budget."""
        return self.call.trunk_tokens

    def step(self, index: int) -> Future[PlainStep | None]:
        """The future of step `index` (from 0): its results, None if the chain ended
        before it, or the error that ended the chain. Taking it counts the steps before it
        as taken."""
        with self._lock:
            self._taken = max(self._taken, index)
            return self._future(index)

    def _future(self, index: int) -> Future[PlainStep | None]:
        future = self._futures.get(index)
        if future is None:
            future = self._futures[index] = Future()
            if self._error is not None and index >= self._published:
                future.set_exception(self._error)
            elif self._stopped and index >= self._published:
                future.set_result(None)
        return future

    def stop(self) -> None:
        """No step after the one running now; the steps not run answer None."""
        with self._lock:
            self._stopped = True
            pending = [f for i, f in self._futures.items() if i >= self._published]
        for future in pending:
            _resolve(future, None)

    @property
    def stopped(self) -> bool:
        with self._lock:
            return self._stopped

    def score_call(self, hidden: HiddenStates) -> ScoreCall:
        """The jury's call for the step now running, over its trunk output."""
        scoring = self.scoring
        return ScoreCall(
            self.session,
            self.call.start,
            hidden,
            scoring.jury,
            scoring.temperature,
            scoring.beta,
            amateur=scoring.amateur,
        )

    def publish(self, draft: DraftResult, score: ScoreResult, seconds: float, share: float) -> bool:
        """On the model thread: the step now running has its draft and score; draws its
        token, hands the step to the session and moves to the next step. Whether the
        chain goes on."""
        scoring = self.scoring
        target = target_rows(score.log_product)
        amateur = score.amateur_logprobs if scoring.amateur is not None else None
        token = plain_step_token(
            target,
            scoring.sampling,
            scoring.seed,
            self.call.start + 1,
            amateur,
            scoring.contrastive_alpha,
        )
        step = PlainStep(draft, score, target, token, seconds, share)
        with self._lock:
            future = self._future(self._published)
            self._published += 1
            self._steps_left -= 1
            goes_on = (
                not self._stopped
                and self._steps_left > 0
                and token not in self._stop_tokens
                and self._published - self._taken <= MAX_UNTAKEN
            )
            if goes_on:
                self.call = dataclasses.replace(self.call, start=self.call.start + 1, pending=token)
            else:
                self._stopped = True
        _resolve(future, step)  # (unless stopped meanwhile: none is waiting for it)
        if not goes_on:
            self.stop()
        return goes_on

    def fail(self, error: BaseException) -> None:
        """The chain ended with `error`: the steps not run raise it."""
        with self._lock:
            self._stopped, self._error = True, error
            pending = [self._future(self._published)]
            pending += [f for i, f in self._futures.items() if i > self._published]
        for future in pending:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)


def _resolve(future: Future, value: object) -> None:
    """Sets `future`'s result unless another thread has already settled it."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(value)
