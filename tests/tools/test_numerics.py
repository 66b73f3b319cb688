"""`make test-numerics` (tools/numerics.py): which CPU capabilities a machine runs."""

from __future__ import annotations

import pytest

from tools.numerics import main, supported_capabilities


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
