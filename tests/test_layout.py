"""Imports go one way (docs/design.md, "The rules of the code"): kernels ← poe ← hydra_model ←
workers ← serving ← {trunk_service, jury_service, orchestrator} ← cli; protos is data
only; the orchestrator imports no service package, only the command line (cli) imports
them all; no server imports the offline tooling in hydra_model.build; every folder is
imported under the one installed namespace, `hydra_jury`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "hydra_jury"
PROJECT = {
    "kernels",
    "poe",
    "hydra_model",
    "workers",
    "serving",
    "protos",
    "trunk_service",
    "jury_service",
    "orchestrator",
    "cli",
}
# package → the project packages it may import (besides itself)
ALLOWED = {
    "kernels": set(),
    "poe": {"kernels"},
    "hydra_model": {"kernels", "poe"},
    "protos": set(),
    "workers": {"kernels", "poe", "hydra_model"},
    "serving": {"kernels", "poe", "hydra_model", "workers", "protos"},
    "trunk_service": {"kernels", "poe", "hydra_model", "workers", "protos", "serving"},
    "jury_service": {"kernels", "poe", "hydra_model", "workers", "protos", "serving"},
    "orchestrator": {"kernels", "poe", "hydra_model", "workers", "protos", "serving"},
    "cli": PROJECT - {"cli"},
}
# modules that may use the offline tooling: the tooling itself, the CLI's build, inspect
# and train-heads commands and its draft-model conversion, and the poisoned-head demo
# (which trains); no server
BUILD_USERS = (
    "hydra_model/build/",
    "cli/model.py",
    "cli/draft.py",
    "orchestrator/poison_demo.py",
)


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


def project_module(module: str) -> str | None:
    """`hydra_jury.poe.rules` → `poe.rules`; None for anything outside the project."""
    prefix = f"{NAMESPACE}."
    return module.removeprefix(prefix) if module.startswith(prefix) else None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    wrong = []
    for path in sources(package):
        relative = str(path.relative_to(REPO))
        for module in filter(None, map(project_module, imported_modules(path))):
            top = module.split(".")[0]
            if top in PROJECT and top != package and top not in ALLOWED[package]:
                wrong.append(f"{relative} imports {module}")
            if module.startswith("hydra_model.build") and not relative.startswith(BUILD_USERS):
                wrong.append(f"{relative} imports the offline tooling {module}")
    assert not wrong, "\n".join(wrong)


def test_project_modules_are_imported_by_their_installed_names():
    """A bare `import poe` works from a checkout but not from the wheel, which installs
    the folders only as `hydra_jury.*`."""
    everything = [*PROJECT, "bench", "tests"]
    bare = [
        f"{path.relative_to(REPO)} imports {module}"
        for folder in everything
        for path in sources(folder)
        for module in imported_modules(path)
        if module.split(".")[0] in PROJECT
    ]
    assert not bare, "\n".join(bare)


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

    packages = ", ".join(f"{NAMESPACE}.{name}" for name in sorted({*ALLOWED, "hydra_model.build"}))
    result = subprocess.run(
        [sys.executable, "-c", f"import {packages}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
