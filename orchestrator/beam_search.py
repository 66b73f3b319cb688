"""Beam search over the PoE target, on either transport (`DecodingBackend`).

Each beam lives in a cache slot of its own on every service: slot 0 is the request's
caches, slot i > 0 the caches named `{cache}:beam{i}`. A step runs every live beam in one
batched trunk forward and one batched jury call (`trunk_forward_batch`, `score_batch`).
Slots are forked and pruned by position, never copied: a beam continues in the free
slot whose tokens share the longest prefix with it (its parent's, when the parent left
one), and only the tokens after that prefix are run (the position rule drops the
rest). Beams that share a long history share it cheaply: a fork re-runs only the tail
since they parted. The bookkeeping (which beams live, which hypotheses are kept) is
`poe.beam.BeamSearch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.orchestrator.backend import DecodingBackend
from hydra_jury.orchestrator.round_timer import RoundTimer
from hydra_jury.orchestrator.sessions.record import common_prefix
from hydra_jury.poe import RequestStats, normalise_logprobs
from hydra_jury.poe.beam import BeamSearch
from hydra_jury.workers.calls import PrefillCall, ScoreCall


def slot_name(cache: str, slot: int) -> str:
    return cache if slot == 0 else f"{cache}:beam{slot}"


@dataclass
class BeamRun:
    """One request's beam search: its caches, its options, what it has cost.

    Every slot that has run holds the context but its last token (`base`) and then a
    tail: the last context token and some beam's tokens. Slots are compared by their
    tails only, so placing the beams costs the generated length, not the context's."""

    backend: DecodingBackend
    cache: str
    jury: tuple[str, ...]
    temperature: float
    beta: float
    stats: RequestStats
    timer: RoundTimer

    def search(self, context: list[int], search: BeamSearch) -> None:
        """Runs `search` to its end from `context` (slot 0 holds all but its last
        token); afterwards slot 0 holds all but the last token of the best hypothesis,
        as the loop's pending-token form expects, and the other slots are freed."""
        base = context[:-1]
        held = {0: []}  # slot -> the tokens it holds after `base` (a slot not run: absent)
        try:
            while not search.done:
                tails = [[context[-1], *beam.tokens] for beam in search.live]
                slots = self._place(tails, held, search.num_beams)
                search.step(self._step(base, tails, slots, held))
            best = search.best()[0]
            self._settle(base, [context[-1], *best.tokens], held)
        finally:
            for slot in range(1, search.num_beams):
                self.backend.release(slot_name(self.cache, slot))

    @staticmethod
    def _place(tails: list[list[int]], held: dict[int, list[int]], slots: int) -> list[int]:
        """A slot for each beam, in order: the free slot sharing the longest prefix with
        it (a slot not run yet shares nothing, not even the context; ties: the lowest).
        A beam's first child so lands in its parent's slot."""
        free = list(range(slots))
        placed = []
        for tail in tails:
            best = max(
                free,
                key=lambda slot: (
                    common_prefix(held[slot], tail) if slot in held else -1,
                    -slot,
                ),
            )
            placed.append(best)
            free.remove(best)
        return placed

    def _step(
        self,
        base: list[int],
        tails: list[list[int]],
        slots: list[int],
        held: dict[int, list[int]],
    ) -> torch.Tensor:
        """Runs each beam's unprocessed tokens in its slot (one batched trunk forward,
        one batched jury call); each beam's next-token target log-probabilities."""
        prefills = []
        for tail, slot in zip(tails, slots, strict=True):
            if slot in held:  # the context is there: run the tail after what it shares
                shared = min(common_prefix(held[slot], tail), len(tail) - 1)
                start, tokens = len(base) + shared, tail[shared:]
            else:
                start, tokens = 0, base + tail
            prefills.append(PrefillCall(slot_name(self.cache, slot), start, torch.tensor(tokens)))
        with self.timer.phase("draft_s"):
            hidden = self.backend.trunk_forward_batch(prefills)
        with self.timer.phase("score_s"):
            scores = self.backend.score_batch(
                [
                    ScoreCall(
                        call.session, call.start, rows, self.jury, self.temperature, self.beta
                    )
                    for call, rows in zip(prefills, hidden, strict=True)
                ]
            )
        self.stats.trunk_steps += sum(len(call.tokens) for call in prefills)
        self.stats.head_evaluations += sum(score.head_evaluations for score in scores)
        for tail, slot in zip(tails, slots, strict=True):
            held[slot] = tail
        last_rows = torch.cat([score.log_product[-1:] for score in scores])  # [B, V]
        return normalise_logprobs(last_rows)

    def _settle(self, base: list[int], tail: list[int], held: dict[int, list[int]]) -> None:
        """Slot 0 brought to `base + tail` but its last token (the pending one)."""
        shared = common_prefix(held[0], tail[:-1])
        if shared < len(tail) - 1:
            tokens = torch.tensor(tail[shared:-1])
            self.backend.prefill(PrefillCall(self.cache, len(base) + shared, tokens, self.jury))
