"""Where a round's wall time goes, by phase, measured by timers patched onto the functions
each phase runs (for one benchmark run, then restored).

A phase's time is exclusive: a timed function called inside another timed one counts
for its own phase only (the jury's PoE maths runs inside the score call, the forward
passes inside the workers). What no timer covers is the loop itself: building calls,
the backend, the hand-off to the model thread, bookkeeping.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hydra_jury.hydra_model import HeadStack, Trunk
from hydra_jury.hydra_model.graphs import StepGraphs
from hydra_jury.orchestrator import engine, rounds
from hydra_jury.orchestrator.rounds import Rounds
from hydra_jury.orchestrator.stopping import StopConditions
from hydra_jury.workers import trunk as trunk_worker
from hydra_jury.workers.calls import DraftResult, HiddenStates, ScoreResult
from hydra_jury.workers.jury import JuryWorker

FORWARD_PHASES = ("trunk forward", "heads forward")
REST = "loop, calls and hand-off"

# Phase -> the (owner, attribute) of every function whose time is the phase's.
PHASES: dict[str, list[tuple[object, str]]] = {
    "trunk forward": [(Trunk, "forward_ragged")],
    "heads forward": [
        (HeadStack, "forward_runs"),
        (HeadStack, "forward_ragged"),
        (HeadStack, "fill_ragged"),
    ],
    "PoE and acceptance": [
        (JuryWorker, "_result"),
        (Rounds, "_sample_target"),
        (Rounds, "_verify"),
        (rounds, "normalise_logprobs"),
        (rounds, "target_rows"),
    ],
    "metrics and records": [(engine, "token_records")],
    "detokenizer and stops": [(StopConditions, "push"), (StopConditions, "delta")],
}
# On a GPU the work is queued, not done, when a call returns: the fixed-shape steps'
# time is their inputs' copies and the graphs' launches (or a first use's recording), and
# the device's time shows where the host waits for it, bringing results back.
DEVICE_PHASES: dict[str, list[tuple[object, str]]] = {
    "fixed-shape steps: inputs and launches": [(StepGraphs, "run")],
    "results to the host: waits for the device": [
        (HiddenStates, "on_host"),
        (ScoreResult, "on_host"),
        (DraftResult, "on_host"),
        (trunk_worker, "to_host"),
    ],
}


class PhaseProfiler:
    def __init__(self, phases: dict[str, list[tuple[object, str]]] = PHASES) -> None:
        self.phases = phases
        self.seconds = dict.fromkeys(phases, 0.0)
        self._inner: list[float] = []  # per open timed call: time of timed calls inside

    def _timed(self, phase: str, function):
        def timed(*args, **kwargs):
            self._inner.append(0.0)
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.perf_counter() - began
                inner = self._inner.pop()
                self.seconds[phase] += spent - inner
                if self._inner:
                    self._inner[-1] += spent

        return timed

    @contextmanager
    def installed(self) -> Iterator[PhaseProfiler]:
        originals = []
        for phase, targets in self.phases.items():
            for owner, name in targets:
                raw = inspect.getattr_static(owner, name)
                originals.append((owner, name, raw))
                if isinstance(raw, staticmethod):
                    setattr(owner, name, staticmethod(self._timed(phase, raw.__func__)))
                else:
                    setattr(owner, name, self._timed(phase, raw))
        try:
            yield self
        finally:
            for owner, name, raw in originals:
                setattr(owner, name, raw)

    def shares(self, wall: float) -> dict[str, float]:
        """Each phase's seconds and the rest (`REST`) of `wall` seconds."""
        return {**self.seconds, REST: wall - sum(self.seconds.values())}

    def outside_forward(self, wall: float) -> float:
        """The fraction of `wall` spent outside the model's forward passes."""
        return 1 - sum(self.seconds[phase] for phase in FORWARD_PHASES) / wall
