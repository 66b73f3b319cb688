"""Imports go one way (ARCHITECTURE.md, "Layout"): poe ← hydra_model ← workers ←
{trunk_service, jury_service, the in-process backend}; serving is used by every server;
protos is data only; the orchestrator imports no service package; no server imports the
offline tooling in hydra_model.build."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = {
    "poe",
    "hydra_model",
    "workers",
    "serving",
    "protos",
    "trunk_service",
    "jury_service",
    "orchestrator",
}
# package → the project packages it may import (besides itself)
ALLOWED = {
    "poe": set(),
    "hydra_model": {"poe"},
    "protos": set(),
    "workers": {"poe", "hydra_model"},
    "serving": {"poe", "hydra_model", "workers", "protos"},
    "trunk_service": {"poe", "hydra_model", "workers", "protos", "serving"},
    "jury_service": {"poe", "hydra_model", "workers", "protos", "serving"},
    "orchestrator": {"poe", "hydra_model", "workers", "protos", "serving"},
}
# modules that may use the offline tooling: the tooling itself and the CLI's build
# and inspect commands
BUILD_USERS = ("hydra_model/build/", "orchestrator/cli.py")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources(package: str) -> list[Path]:
    return [
        path
        for path in sorted((REPO / package).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    wrong = []
    for path in sources(package):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in PROJECT and top != package and top not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
            relative = str(path.relative_to(REPO))
            if module.startswith("hydra_model.build") and not relative.startswith(BUILD_USERS):
                wrong.append(f"{relative} imports the offline tooling {module}")
    assert not wrong, "\n".join(wrong)


def test_no_module_shadows_the_standard_library():
    import sys

    shadowing = [
        str(path.relative_to(REPO))
        for package in ALLOWED
        for path in sources(package)
        if path.stem in sys.stdlib_module_names
    ]
    assert not shadowing, shadowing


def test_every_package_is_installed(tmp_path):
    """The installed project (not the checkout on sys.path) provides every package, so
    `hydra-jury` and `python bench/...` work from anywhere."""
    import subprocess
    import sys

    packages = ", ".join(sorted({*ALLOWED, "hydra_model.build"}))
    result = subprocess.run(
        [sys.executable, "-c", f"import {packages}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
