"""`make test-numerics` (tools/numerics.py): which CPU capabilities a machine runs."""

from __future__ import annotations

import os

import pytest

from tools.numerics import main, side_by_side, supported_capabilities


@pytest.mark.parametrize(
    ("native", "supported"),
    [
        ("avx512", ["default", "avx2", "avx512"]),
        ("avx2", ["default", "avx2"]),
        ("default", ["default"]),
        ("sve256", ["default", "sve256"]),  # off x86: the native path and the plain one
    ],
)
def test_every_capability_up_to_the_native_one(native, supported):
    assert supported_capabilities(native) == supported


def test_a_capability_the_cpu_lacks_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--capabilities", "avx9000"])
    assert exit_info.value.code == 2
    assert "not avx9000" in capsys.readouterr().err


def test_runs_side_by_side_fit_their_threads_in_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [side_by_side(threads) for threads in (1, 2, 4)] == [2, 1, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [side_by_side(threads) for threads in (1, 2, 4)] == [16, 8, 4]
