"""Compute threads: a generation thread beside the model thread runs its torch ops on
itself alone (no OpenMP team, no MKL threads of its own), and that changes no other
thread's count, nor the count of threads set up later."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from hydra_jury.poe import target_rows
from hydra_jury.serving.model_thread import compute_on_this_thread_alone


def in_a_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


def tasks() -> set[str]:
    """This process's thread ids. Compared as sets: threads left by earlier tests in the
    same worker may exit meanwhile, which a difference of counts would read as -1."""
    return set(os.listdir("/proc/self/task"))


def mkl_threads() -> int | None:
    """MKL's thread count for this thread (None: torch has no MKL here)."""
    library = ctypes.CDLL(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
    return library.MKL_Get_Max_Threads() if hasattr(library, "MKL_Get_Max_Threads") else None


def test_a_thread_computing_alone_starts_no_team_and_changes_no_other_thread():
    default, default_mkl = torch.get_num_threads(), mkl_threads()
    logits = torch.randn(5, 49_152)  # the loop's maths: parallel ops and exp

    def alone() -> tuple[int, int | None, set[str]]:
        compute_on_this_thread_alone()
        before = tasks()
        for _ in range(5):
            # The round's passes by the native kernels must not set the count back either.
            target_rows(logits)
            logits.log_softmax(-1).exp().sum(-1)
        return torch.get_num_threads(), mkl_threads(), tasks() - before

    # One thread for torch's loops and for MKL's, and no thread started for it.
    assert in_a_thread(alone) == (1, None if default_mkl is None else 1, set())
    assert (torch.get_num_threads(), mkl_threads()) == (default, default_mkl)
    # A thread set up afterwards gets the defaults.
    assert in_a_thread(lambda: (torch.get_num_threads(), mkl_threads())) == (
        default,
        default_mkl,
    )


def orchestrator_threads(count: int | None, environment: dict[str, str]) -> int:
    """torch's thread count in a fresh process after `set_orchestrator_threads(count)`."""
    script = (
        "import torch\n"
        "from hydra_jury.serving.model_thread import set_orchestrator_threads\n"
        f"set_orchestrator_threads({count!r})\n"
        "print(torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | environment
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_the_orchestrator_computes_on_one_thread_unless_told_otherwise():
    assert orchestrator_threads(None, {}) == 1
    assert orchestrator_threads(None, {"OMP_NUM_THREADS": "2"}) == 2  # the chart's value
    assert orchestrator_threads(3, {"OMP_NUM_THREADS": "2"}) == 3  # the flag wins
