"""`make gpu-bundle` (tools/gpu_bundle.py): the packages a GPU machine lacks, at the lock's
versions, and the script that runs the gpu tests and bench-gpu there. The download
itself needs a package index and is not run here."""

from __future__ import annotations

import subprocess
from importlib.metadata import requires

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.gpu_bundle import MISSING, RUN_SH, download_command, pins
from tools.lock import read_lock


def test_every_package_the_bundle_carries_brings_its_own_dependencies():
    """Installed with --no-deps, the bundle must hold what its packages require, but
    what the GPU machine's own stack gives (none of them requires torch or numpy)."""
    carried = {canonicalize_name(name) for name in MISSING}
    environment = {"extra": "", "python_version": "3.12"}
    lacking = []
    for name in MISSING:
        for text in requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate(environment):
                continue
            if canonicalize_name(requirement.name) not in carried:
                lacking.append(f"{name} needs {requirement.name}")
    assert not lacking, lacking


def test_the_bundle_s_versions_are_the_lock_s():
    locked = read_lock()
    for pin in pins(list(MISSING)):
        name, version = pin.split("==")
        assert locked[canonicalize_name(name)] == version
    with pytest.raises(SystemExit, match=r"not in requirements\.lock: no-such-package"):
        pins(["grpcio", "no-such-package"])


def test_the_download_takes_binary_wheels_for_the_gpu_machine_s_python(tmp_path):
    command = download_command(["grpcio==1.0"], "3.12", tmp_path)
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--dest") + 1] == str(tmp_path)
    assert command[-1] == "grpcio==1.0"


def test_the_run_script_is_valid_bash(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(RUN_SH)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "pytest -m gpu tests/gpu" in RUN_SH and "bench/bench_gpu.py" in RUN_SH
