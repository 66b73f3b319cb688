"""Seeded runs of the in-process engine spread over worker processes, for the tests that
compare thousands of runs with a closed-form distribution (`test_engine_distribution`).

Each run is keyed by its seed alone (random draws are keyed by seed and position), so
splitting the seeds between processes gives exactly the counts of one process running
them all; the tests run one compute thread each, and a worker per core uses the others.
Workers are spawned (a fork would copy the parent's gRPC and Redis threads mid-state)
and build their own engine from the checkpoints on disk once.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.workers.sessions import SessionLimits

_engine: Engine | None = None  # the worker's own


def first_two_tokens(engine: Engine, request: GenerationRequest) -> list[int]:
    """The first two generated tokens: the generation runs only the rounds that decide
    them (its first round still drafts γ tokens), then is closed."""
    generation = engine.start(request)
    tokens: list[int] = []
    for output in generation:
        tokens += [record.token_id for record in output.tokens]
        if len(tokens) >= 2:
            break
    generation.close()
    return tokens[:2]


def _start_worker(checkpoint: Path, draft_checkpoint: Path, threads: int) -> None:
    global _engine
    torch.set_num_threads(threads)
    model = HydraModel.load(checkpoint)
    # One session of 32 positions is all a run of the first two tokens needs.
    backend = LocalBackend(
        model, draft_model=DraftModel.load(draft_checkpoint), limits=SessionLimits(1, 32)
    )
    _engine = Engine(backend, model.load_tokenizer())


def _first_two_of_seeds(options: dict, seeds: range) -> list[list[int]]:
    return [first_two_tokens(_engine, GenerationRequest(seed=seed, **options)) for seed in seeds]


class RunSampler:
    """`workers` processes, each with its own engine over the same checkpoints. The first
    two tokens of every seed run are kept, so a test comparing other runs with them
    seed for seed reuses another test's runs."""

    def __init__(self, checkpoint: Path, draft_checkpoint: Path, workers: int) -> None:
        self.workers = workers
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(checkpoint, draft_checkpoint, torch.get_num_threads()),
        )
        self._runs: dict[str, list[list[int]]] = {}

    def first_two(self, options: dict, runs: int) -> list[list[int]]:
        """The first two tokens of the runs of seeds 0 .. runs − 1 with `options`, in
        seed order (only the seeds not run before with these options are run)."""
        key = repr(sorted(options.items()))
        done = self._runs.setdefault(key, [])
        if len(done) < runs:
            done += self._run_seeds(options, range(len(done), runs))
        return done[:runs]

    def _run_seeds(self, options: dict, seeds: range) -> list[list[int]]:
        size = -(-len(seeds) // self.workers)
        chunks = [seeds[start : start + size] for start in range(0, len(seeds), size)]
        tokens: list[list[int]] = []
        for part in self.pool.map(_first_two_of_seeds, [options] * len(chunks), chunks):
            tokens += part
        return tokens

    def close(self) -> None:
        self.pool.shutdown()


def worker_count() -> int:
    """A worker per core the tests may use."""
    return max(1, len(os.sched_getaffinity(0)))
