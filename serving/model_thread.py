"""The model thread: model compute runs here, off the event loop, one call at a time.
The place where a batch scheduler will later own the step loop.

Load the model and build its caches on this thread too, so that
no other thread of the process ever runs parallel CPU work: OpenMP keeps a team of
threads for every thread that did, and once a process's teams hold more threads than
there are cores, libgomp stops spinning between parallel regions and every region pays
a wake-up. Measured on the 2-core development machine, that is the difference between
16.4 and 18.7 tokens/s (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

T = TypeVar("T")


async def start_model_thread(name: str, build: Callable[[ModelThread], T]) -> T:
    """Starts a model thread with this thread's torch thread count and runs
    `build(thread)` on it (load the model, build the caches and the servicer there);
    shuts the thread down again if that fails."""
    thread = ModelThread(name)
    try:
        await thread.run(torch.set_num_threads, torch.get_num_threads())
        return await thread.run(build, thread)
    except BaseException:
        await asyncio.to_thread(thread.shutdown)
        raise


def set_compute_threads(count: int | None) -> None:
    """A `--threads` option: the CPU threads model threads started from here will use
    (None: torch's default)."""
    if count is None:
        return
    if count < 1:
        raise ValueError(f"--threads must be at least 1, got {count}")
    torch.set_num_threads(count)


def in_executor(executor: Executor, function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`function(*args)` on `executor`, in the caller's context (its trace span stays
    current): `asyncio.to_thread` for an executor of one's own. Await the future for its
    result."""
    run = contextvars.copy_context().run
    return asyncio.get_running_loop().run_in_executor(executor, partial(run, function, *args))


class ModelThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._started
        )
        self._ident: int | None = None

    def _started(self) -> None:
        self._ident = threading.get_ident()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the model thread, awaited from the event loop, in the
        caller's context (its trace span stays current)."""
        return await in_executor(self._executor, function, *args)

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the model thread, waited for by a plain thread (or run
        at once when called from the model thread itself), in the caller's context."""
        if threading.get_ident() == self._ident:
            return function(*args)
        return self._executor.submit(contextvars.copy_context().run, function, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
