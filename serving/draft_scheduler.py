"""The trunk service's draft calls in progress, owned by one scheduler: continuous
batching at the step.

A head draft or plain step runs one position per batch of the `Draft` batcher. In each
batch the new calls start, each alone (a refused call fails alone; a draft-model call
runs whole and ends there), then every call drafting advances one position together: one
trunk forward over all of them, one forward per draft head (`TrunkWorker.begin_drafts`,
`TrunkWorker.draft_step`). A call answers `CONTINUE` to the batcher until its γ
positions are done, so a new call joins at the step after it arrives. A session drafts
one call at a time: a second call of it is refused while the first runs. A session
released while drafting fails its call alone; a step that fails fails every call in it,
and their sessions are let go (`TrunkWorker.abandon`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from hydra_jury.serving.batcher import CONTINUE
from hydra_jury.workers.calls import DraftCall, DraftResult
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.trunk import Drafting, TrunkWorker


class _OfSession(Protocol):
    @property
    def session(self) -> str: ...


Ticket = TypeVar("Ticket", bound=_OfSession)


class DraftScheduler(Generic[Ticket]):
    """The draft calls in progress of one trunk worker, stepped together by `run` (one
    batch at a time, on the model thread).

    A call arrives as a ticket, the object the batcher queued (the service's request),
    that names the session of the call it decodes to. The scheduler keys its calls by
    session, and recognises a call in progress by the identity of its ticket: the
    batcher hands back the very object that answered `CONTINUE` in every batch until the
    call ends, while a second call of the same session (a retry, say) arrives as another
    object, equal or not, and is refused."""

    def __init__(self, worker: TrunkWorker) -> None:
        self.worker = worker
        self._drafting: dict[str, tuple[Ticket, Drafting]] = {}  # session -> ticket, call

    def __len__(self) -> int:
        """The calls in progress."""
        return len(self._drafting)

    def run(
        self, tickets: list[Ticket], decode: Callable[[Ticket], DraftCall]
    ) -> list[DraftResult | Exception | object]:
        """One batch: the new tickets start (`decode` builds each one's call; its error is
        the ticket's), then one step of every call drafting. For each ticket, in order:
        its call's result once done, its error, or `CONTINUE` while it goes on."""
        ended: dict[int, DraftResult | Exception] = {}  # by place: calls ended this batch
        for place, ticket in enumerate(tickets):
            if self._drafting_of(ticket) is None:
                outcome = self._begin(ticket, decode)
                if outcome is not None:
                    ended[place] = outcome
        drafting = [entry for entry in map(self._drafting_of, tickets) if entry is not None]
        try:
            self.worker.draft_step(drafting)
        except Exception as error:
            self.worker.abandon(drafting)
            for place, ticket in enumerate(tickets):
                if self._drafting_of(ticket) is not None:
                    del self._drafting[ticket.session]
                    ended[place] = error
        return [
            ended[place] if place in ended else self._finish(ticket)
            for place, ticket in enumerate(tickets)
        ]

    def _drafting_of(self, ticket: Ticket) -> Drafting | None:
        """The call in progress that `ticket` began, if any."""
        entry = self._drafting.get(ticket.session)
        if entry is None or entry[0] is not ticket:
            return None
        return entry[1]

    def _begin(
        self, ticket: Ticket, decode: Callable[[Ticket], DraftCall]
    ) -> DraftResult | Exception | None:
        """Starts one call: its result when it ran whole, its error, or None once it is
        drafting."""
        try:
            call = decode(ticket)
            if ticket.session in self._drafting:
                raise InvalidArgument(
                    f"session {ticket.session!r}: another draft call of it is still running"
                )
            (started,) = self.worker.begin_drafts([call])
        except Exception as error:
            return error
        if isinstance(started, Drafting):
            self._drafting[ticket.session] = (ticket, started)
            return None
        return started

    def _finish(self, ticket: Ticket) -> DraftResult | Exception | object:
        """A drafting ticket after the step: `CONTINUE`, or its result or error once its
        call is done (the call then leaves the scheduler)."""
        entry = self._drafting[ticket.session][1]
        if not entry.done:
            return CONTINUE
        del self._drafting[ticket.session]
        try:
            return entry.result()
        except Exception as error:
            return error
