"""The generations of one HTTP request — its `n` choices — run at once, each through
`GenerationServicer.generate` on a session of its own.

Sessions: a request that names none runs on a session made for it, and the session is
closed (its record deleted, its caches freed) when the choice ends — however it ends: at
its last round, on an error, or cancelled because the client went away. So each request
stands alone, as in OpenAI's API, and leaves nothing behind. A kept session
(`keep_session`) stays for the next turn once a round was committed on it. The session
is made before the generation (CreateSession's path) so that its id is known whatever
happens next.

Each choice runs in a task of its own, which cleans up after itself: cancelling a choice
(`cancel`) cannot be undone by the caller being cancelled again meanwhile, as a request
handler is when its client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hydra_jury.orchestrator.request_log import Call
from hydra_jury.orchestrator.sessions.runner import Committed
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving.api_keys import ApiKey

if TYPE_CHECKING:  # the server module imports this package
    from hydra_jury.orchestrator.server import GenerationServicer

log = logging.getLogger("hydra_jury.http")

_ROUND, _ERROR, _END = "round", "error", "end"


class Choices:
    """Starts one generation per request of `requests` (an HTTP request's choices) with
    `key`, for the API `call`; `rounds()` yields (choice index, committed round) as they come."""

    def __init__(
        self,
        servicer: GenerationServicer,
        requests: list[generation_pb2.GenerateRequest],
        key: ApiKey | None,
        call: Call,
        *,
        keep_session: bool,
        running: set[asyncio.Task],
    ) -> None:
        """`running`: where the tasks are held until they end (asyncio keeps only weak
        references to tasks)."""
        self.servicer, self.key, self.call, self.keep_session = servicer, key, call, keep_session
        self._events: asyncio.Queue = asyncio.Queue()
        self.tasks = [
            asyncio.get_running_loop().create_task(self._run(index, request))
            for index, request in enumerate(requests)
        ]
        for task in self.tasks:
            running.add(task)
            task.add_done_callback(running.discard)

    async def rounds(self) -> AsyncIterator[tuple[int, Committed]]:
        """Every choice's committed rounds, in the order they come; a choice's error is
        raised (and the other choices cancelled)."""
        ended = 0
        try:
            while ended < len(self.tasks):
                kind, index, item = await self._events.get()
                if kind == _ERROR:
                    raise item
                if kind == _END:
                    ended += 1
                else:
                    yield index, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stops the choices still running (each frees its session by itself)."""
        for task in self.tasks:
            task.cancel()

    async def _run(self, index: int, request: generation_pb2.GenerateRequest) -> None:
        runner = self.servicer.runner
        key_name = self.key.name if self.key else ""
        made, committed = "", False
        try:
            if not request.session_id:
                made = request.session_id = await runner.create_session(None, key_name)
            rounds = self.servicer.generate(request, self.key, None, self.call)
            async with contextlib.aclosing(rounds):
                async for item in rounds:
                    committed = True
                    self._events.put_nowait((_ROUND, index, item))
        except Exception as error:
            self._events.put_nowait((_ERROR, index, error))
        finally:
            self._events.put_nowait((_END, index, None))
            if made and not (self.keep_session and committed):
                await self._close(made, key_name)

    async def _close(self, session_id: str, key_name: str) -> None:
        try:
            await self.servicer.runner.close_session(session_id, key_name)
        except Exception as error:  # Redis down: the session expires by itself
            log.warning("could not close session %s: %s", session_id, error)
