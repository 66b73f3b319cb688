"""The lock (requirements.lock, tools/lock.py): pyproject.toml's ranges admit every locked
version, the lock is used wherever the project installs itself, and the environment the tests
run in is the lock's."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.lock import LOCK, PROJECT, installed, read_lock, render

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def declared_requirements() -> list[Requirement]:
    """Every requirement pyproject.toml declares: the project's, each extra's and the
    build's, those whose markers hold here."""
    project = PYPROJECT["project"]
    texts = list(project["dependencies"]) + list(PYPROJECT["build-system"]["requires"])
    for extra in project["optional-dependencies"].values():
        texts += extra
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_the_ranges_admit_every_locked_version():
    pins = read_lock()
    missing, outside = [], []
    for requirement in declared_requirements():
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            missing.append(requirement.name)
        elif not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement.name} {version} is outside {requirement.specifier}")
    assert not missing, f"declared but not locked (run `make lock`): {missing}"
    assert not outside, "\n".join(outside)


def test_the_lock_is_as_make_lock_writes_it():
    text = LOCK.read_text()
    python, machine = re.search(r"resolved for Python (\S+) on Linux (\S+)\.", text).groups()
    assert render(read_lock(), python, machine) == text, "edited by hand? run `make lock`"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == python
    assert canonicalize_name(PROJECT) not in read_lock()


def test_every_install_uses_the_lock():
    makefile = (REPO / "Makefile").read_text()
    setup_recipe = makefile[makefile.index("$(STAMP): pyproject.toml $(LOCK)") :]
    setup_recipe = setup_recipe[: setup_recipe.index("\n\n")]
    pip_install = re.search(r"^PIP_INSTALL := (.*)$", makefile, re.M)[1]
    setup_recipe = setup_recipe.replace("$(PIP_INSTALL)", pip_install)
    installs = [line for line in setup_recipe.splitlines() if "pip install" in line]
    assert installs and all("-c $(LOCK)" in line for line in installs), installs
    assert "make test" in (REPO / ".ci" / "run").read_text()
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    image_installs = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", dockerfile)
    assert image_installs and all("requirements.lock" in cmd for cmd in image_installs)


@pytest.mark.locked_environment
def test_the_environment_is_the_lock():
    """Every package installed here is locked at the version installed, and every locked
    package is installed: the tests ran on exactly the lock."""
    pins, present = read_lock(), installed(sys.executable)
    differ = {
        name: (present.get(name), pins.get(name))
        for name in pins.keys() | present.keys()
        if present.get(name) != pins.get(name)
    }
    assert not differ, f"installed vs locked (run `make setup`): {differ}"
