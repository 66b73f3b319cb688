"""Continuous batching for the single-process server: the trunk and jury workers' calls
from concurrent generations run as the split services run them, one forward over the
sessions whose calls arrive together.

Each generation runs its rounds on a thread of its own and calls `submit`, which blocks
until its call's batch has run. The batchers (`serving.batcher.CallBatcher`, the split
services' own: admission control, the token budget, the batch window, metrics) live on an
event loop of their own thread and run each batch on the model thread:

- **prefill**: the trunk's ragged forward, then the jury's, over every session's tokens
  (a long prompt in chunks, each in its own batch, as the trunk service chunks it);
- **trunk forward**: the trunk alone (a beam search's step over its beams);
- **draft**: one step per batch of every session drafting (`DraftScheduler`): a call
  joins at the next step and leaves when its γ steps are done. A plain step and a
  one-pass check of outside drafts (its pending token and drafts) are one step each, so
  a one-pass round shares the plain steps' trunk forward instead of running one of its
  own beside it;
- **score**: the jury's ragged forward over every session's drafted positions.

A call that fails fails alone (`run_isolated`); results come back on the host, as the
loop gets them over gRPC.

One batcher per kind, as in the split services, rather than one step of the model thread
running every queued call whatever its kind: measured side by side (8 sessions, 2-core
Intel Xeon, float32, SmolLM2 demo split), one batcher for every kind gave 46 tokens/s
against 50–52 non-speculative and 42–44 against 41.5 speculative. Its steps were bigger,
but every session's share of the loop's maths (Python, one session at a time under the
GIL) then ran while the model waited; with a batcher per kind, a Draft batch runs while
the sessions just scored do their maths.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from hydra_jury.serving.batcher import BatchLimits, CallBatcher, run_isolated
from hydra_jury.serving.draft_scheduler import DraftScheduler
from hydra_jury.serving.metrics import ServiceMetrics
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    JuryPrefillCall,
    PrefillCall,
    ScoreCall,
    ScoreResult,
)
from hydra_jury.workers.jury import JuryWorker
from hydra_jury.workers.trunk import TrunkWorker


def prefill_chunks(call: PrefillCall, size: int) -> list[PrefillCall]:
    """`call` as chunks of at most `size` positions, in order (0: whole)."""
    tokens = call.tokens
    if size <= 0 or len(tokens) <= size:
        return [call]
    return [
        PrefillCall(call.session, call.start + offset, tokens[offset : offset + size], call.heads)
        for offset in range(0, len(tokens), size)
    ]


class WorkerBatchers:
    """The batched calls of one trunk worker and one jury worker that share a model
    thread. `metrics` (optional) gets each batcher's batches, waits and refusals under
    the names the split services use ("Prefill", "Draft", "Score"; "TrunkForward")."""

    def __init__(
        self,
        trunk: TrunkWorker,
        jury: JuryWorker,
        thread: ModelThread,
        limits: BatchLimits | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.trunk, self.jury, self.limits = trunk, jury, limits or BatchLimits()
        self.thread = thread
        self._drafts = DraftScheduler[DraftCall](trunk)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="batching", daemon=True
        )
        self._loop_thread.start()

        def batcher(
            rpc: str, handle: Callable, size: Callable[[Any], int], recurring: bool = True
        ) -> CallBatcher:
            observer = metrics.observer(rpc) if metrics is not None else None
            return CallBatcher(rpc, thread, handle, size, self.limits, observer, recurring)

        self.batchers: dict[str, CallBatcher] = {
            "Prefill": batcher(
                "Prefill", self._prefill_batch, lambda call: len(call.tokens), recurring=False
            ),
            "TrunkForward": batcher(
                "TrunkForward", self._trunk_forward_batch, lambda call: len(call.tokens)
            ),
            # A position per step; a one-pass check's step, its pending token and drafts.
            "Draft": batcher("Draft", self._draft_batch, lambda call: len(call.trunk_tokens)),
            "Score": batcher("Score", self._score_batch, lambda call: call.hidden.rows),
        }

    def submit(self, rpc: str, call: Any, started: threading.Event | None = None) -> Future:
        """Queues `call` for the batcher of `rpc`; the future of its result and its share
        of the batches it ran in (`CallBatcher.submit_shared`; `started` is set when its
        first batch begins on the model thread)."""
        return asyncio.run_coroutine_threadsafe(
            self.batchers[rpc].submit_shared(call, started), self._loop
        )

    def chunks(self, call: PrefillCall) -> list[PrefillCall]:
        """A prefill as its batches will run it: the whole call checked first, so that no
        chunk after the first fails; a newcomer with every slot running refused at once,
        not behind the running sessions' batches."""
        self.trunk.sessions.check_room(call.session, call.start)
        chunks = prefill_chunks(call, self.limits.prefill_chunk)
        if len(chunks) > 1:
            self.trunk.check_prefill(call)
        return chunks

    def left(self, session: str) -> None:
        """`session`'s generation has ended: the batches stop waiting for its next call
        (`ModelThread.session_left`). From any thread."""
        self._loop.call_soon_threadsafe(self.thread.session_left, session)

    def close(self) -> None:
        """Stops the batchers' loop (after the generations have stopped)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()

    # --- the batches, on the model thread -------------------------------------------

    def _prefill_batch(self, calls: list[PrefillCall]) -> list[Exception | None]:
        def run(batch: list[PrefillCall]) -> list[None]:
            hidden = self.trunk.prefill_batch(batch)
            return self.jury.prefill_batch(
                [
                    JuryPrefillCall(call.session, call.start, states, call.heads)
                    for call, states in zip(batch, hidden, strict=True)
                ]
            )

        return run_isolated(calls, run, lambda call: run([call])[0])

    def _trunk_forward_batch(self, calls: list[PrefillCall]) -> list[HiddenStates | Exception]:
        # The hidden states stay on the model's device, for the jury's score call.
        return run_isolated(calls, self.trunk.prefill_batch, self.trunk.prefill)

    def _draft_batch(self, calls: list[DraftCall]) -> list[DraftResult | Exception | object]:
        outcomes = self._drafts.run(calls, lambda call: call)
        return [
            outcome.on_host() if isinstance(outcome, DraftResult) else outcome
            for outcome in outcomes
        ]

    def _score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult | Exception]:
        results = run_isolated(calls, self.jury.score_batch, self.jury.score)
        return [
            result.on_host() if isinstance(result, ScoreResult) else result for result in results
        ]
