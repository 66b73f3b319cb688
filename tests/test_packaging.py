"""The wheel is complete without `make protos`: built from a copy of the source tree that
holds no generated code, it carries the .proto files and the code generated from them
(by setup.py's build hook), and an unpacked copy imports the servers and the CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROTO_PACKAGE = "protos/hydrajury/v1"
PROTOS = sorted(path.stem for path in (REPO / PROTO_PACKAGE).glob("*.proto"))
NAMESPACE = "hydra_jury"
# What a fresh checkout lacks: environments, build outputs, caches and generated code.
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "var",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*_pb2.py",
    "*_pb2.pyi",
    "*_pb2_grpc.py",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "hydra-jury"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    # The control: whatever generated code the wheel holds, the build made it.
    assert not list(source.rglob("*_pb2*.py"))
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, f"--wheel-dir={out}", str(source)], check=True, capture_output=True)
    (built,) = out.glob("hydra_jury-*.whl")
    return built


def test_the_wheel_carries_protos_and_generated_code(wheel):
    assert {"generation", "internal", "tensor"} <= set(PROTOS)
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{NAMESPACE}/{PROTO_PACKAGE}/{stem}{suffix}"
        for stem in PROTOS
        for suffix in (".proto", "_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    }
    assert expected <= names, sorted(expected - names)
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert (
        f"hydra-jury = {NAMESPACE}.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_the_wheel_carries_the_kernels_sources(wheel):
    """The native kernels are compiled where they run: the wheel carries their sources."""
    from hydra_jury.kernels.native import SOURCES

    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{NAMESPACE}/kernels/{source}" for source in SOURCES}
    assert expected <= names, sorted(expected - names)


def test_the_wheel_claims_one_top_level_name(wheel):
    """Every module installs under `hydra_jury`: no generic `protos` or `workers` in
    site-packages."""
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {NAMESPACE}
    names = [name for name in zipfile.ZipFile(wheel).namelist() if name.startswith(f"{NAMESPACE}/")]
    # Every package folder of the checkout but the tests and the tooling.
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")} - {"tests", "tools"}
    assert {name.split("/")[1] for name in names} == packages


def test_an_unpacked_wheel_imports_the_servers_and_the_cli(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    modules = [
        *(f"protos.hydrajury.v1.{stem}_pb2_grpc" for stem in PROTOS),
        "trunk_service.server",
        "jury_service.server",
        "orchestrator.server",
        "cli",
    ]
    modules = [f"{NAMESPACE}.{module}" for module in modules]
    # The unpacked copy goes first on the path, ahead of the editable install's finder.
    script = (
        f"import importlib, sys; sys.path.insert(0, {str(tmp_path)!r}); "
        f"print('\\n'.join(importlib.import_module(m).__file__ for m in {modules!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    files = result.stdout.split()
    assert len(files) == len(modules)
    assert all(Path(file).is_relative_to(tmp_path) for file in files), files
