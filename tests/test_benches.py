"""The in-process benchmarks still run: each on the tiny jury checkpoint with the
smallest settings, as `make bench` runs it on the demo checkpoint. (`bench-batching`
had stopped running for weeks before anyone ran `make bench`: it patched a runtime
method whose signature had changed.) Their figures are not checked here, only that each
finishes and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BENCHES = {
    "batching": ["bench_batching.py", "--sessions", "1,2", "--repeats", "1", "--contexts", "8,20"],
    "round": ["bench_round.py", "--new-tokens", "4", "--runs", "1"],
    "engine": ["bench_engine.py", "--new-tokens", "4"],
}


@pytest.mark.parametrize("bench", list(BENCHES))
def test_a_benchmark_runs_and_prints_its_table(bench, wide_jury_checkpoint):
    script, *options = BENCHES[bench]
    checkpoint = ["--checkpoint", str(wide_jury_checkpoint)]
    finished = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *checkpoint, *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [line for line in finished.stdout.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, finished.stdout  # a header, its rule and a row at least
    if bench == "batching":  # a row per dtype and session count
        assert len([row for row in rows if row.startswith(("| float32", "| bfloat16"))]) == 4
