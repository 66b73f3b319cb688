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
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from hydra_jury.serving.host_turn import HostTurn

T = TypeVar("T")


async def start_model_thread(name: str, build: Callable[[ModelThread], T]) -> T:
    """Starts a model thread with this thread's torch thread count and runs
    `build(thread)` on it (load the model, build the caches and the servicer there);
    shuts the thread down again if that fails."""
    thread = ModelThread(name)
    try:
        await thread.run(use_compute_threads, torch.get_num_threads())
        return await thread.run(build, thread)
    except BaseException:
        await asyncio.to_thread(thread.shutdown)
        raise


def use_compute_threads(count: int) -> None:
    """Starts a model thread's torch: `count` CPU threads, set up now.

    torch sets up each thread's OpenMP thread count on its first parallel op there, from
    the count last given to `torch.set_num_threads` by any thread; asking for the count
    at once does that set-up now, so that no later call elsewhere changes this one's."""
    torch.set_num_threads(count)
    torch.get_num_threads()


def compute_on_this_thread_alone() -> None:
    """This thread's torch ops run on it alone from now on, starting no OpenMP team:
    for threads beside a model thread (the single-process server's generation threads),
    whose teams would otherwise hold more threads than there are cores (see above).

    Not `torch.set_num_threads(1)`: that also becomes the count every thread set up
    later takes — the native kernels' first parallel op on the model thread included.
    The runtimes' own per-thread calls change this thread's count alone: OpenMP's (torch's
    parallel loops) and MKL's (its vector maths, `exp` say, which keeps a count of its
    own), once torch's set-up of the thread, which would overwrite them, is done. A
    runtime the process does not have (another platform) is left alone."""
    torch.get_num_threads()
    for set_threads in _per_thread_setters():
        set_threads(1)


@functools.cache
def _per_thread_setters() -> tuple[Callable[[int], Any], ...]:
    """The per-thread thread-count calls of the OpenMP runtime torch loaded (libgomp or
    libiomp) and of the MKL inside torch, where the process has them."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return ()
    paths = {Path(line.split()[-1]) for line in maps.read_text().splitlines() if "/" in line}
    wanted = {"omp_set_num_threads": ("libgomp", "libiomp")}
    # MKL's C entry point (`mkl_set_num_threads_local` is its macro, and the symbol of
    # that name the Fortran one, which takes a pointer).
    wanted["MKL_Set_Num_Threads_Local"] = ("libtorch_cpu", "libmkl_rt")
    setters = []
    for symbol, libraries in wanted.items():
        for path in sorted(paths):
            if path.name.startswith(libraries) and hasattr(library := ctypes.CDLL(path), symbol):
                setters.append(getattr(library, symbol))
                break
    return tuple(setters)


def set_compute_threads(count: int | None) -> None:
    """A `--threads` option: the CPU threads model threads started from here will use
    (None: torch's default)."""
    if count is None:
        return
    if count < 1:
        raise ValueError(f"--threads must be at least 1, got {count}")
    torch.set_num_threads(count)


def set_orchestrator_threads(count: int | None) -> None:
    """The orchestrator's CPU threads for torch: `count`, else what $OMP_NUM_THREADS says
    (torch has read it), else one. A round's own maths there is small (the shards' rows
    summed, the target's rows, a draw), and an OpenMP team of its own spins on the cores
    between regions: beside the services on one host it takes them from their steps. An
    engine over the local stack's services, 48-token greedy requests on the 2-core Intel
    machine, made 20.5–21.8 non-speculative tokens/s with libgomp's default wait, 22.7–26.0
    with one thread (23.6–25.3 waiting passively, as `hydra-jury up` starts it)."""
    if count is None and os.environ.get("OMP_NUM_THREADS"):
        return
    set_compute_threads(1 if count is None else count)


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
        self._turn: asyncio.Lock | None = None
        self._arrivals: asyncio.Event | None = None
        self.batchers: list[Any] = []  # the CallBatchers that run their batches here
        # The batcher of the thread's last batch and the sessions whose calls it
        # completed: their next calls are on their way to the thread's other batchers.
        self.last_done: tuple[Any, frozenset[str]] | None = None
        # Services sharing the host's cores take turns for their batches (None: alone).
        self.host_turn: HostTurn | None = None

    def _started(self) -> None:
        self._ident = threading.get_ident()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the model thread, awaited from the event loop, in the
        caller's context (its trace span stays current)."""
        return await in_executor(self._executor, function, *args)

    def turn(self) -> asyncio.Lock:
        """The batchers' turn on this thread (they share one event loop): a batcher
        holds it from choosing its batch until the batch has run, so that calls arriving
        while another batch runs join the next one instead of waiting behind a batch
        already chosen."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    def arrivals(self) -> asyncio.Event:
        """Set when a call arrives at any of the batchers (the batch window waits on it)."""
        if self._arrivals is None:
            self._arrivals = asyncio.Event()
        return self._arrivals

    def session_left(self, session: str) -> None:
        """`session`'s generation has ended: no batcher waits for its next call. On the
        event loop."""
        for batcher in self.batchers:
            batcher.forget(session)
        if self.last_done is not None and session in self.last_done[1]:
            self.last_done = (self.last_done[0], self.last_done[1] - {session})
        if self._arrivals is not None:
            self._arrivals.set()

    def others_pending(self, batcher: Any) -> bool:
        """Whether a batcher other than `batcher` has calls waiting for this thread."""
        return any(other.pending for other in self.batchers if other is not batcher)

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the model thread, waited for by a plain thread (or run
        at once when called from the model thread itself), in the caller's context."""
        if threading.get_ident() == self._ident:
            return function(*args)
        return self._executor.submit(contextvars.copy_context().run, function, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.host_turn is not None:
            self.host_turn.close()
