"""The chart's tools: helm (fetched once into var/tools by deploy/tools/fetch_helm.py)
and kubernetes-validate (the dev extra), and a renderer of the chart."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "hydra-jury"
RELEASE = "hj"


@pytest.fixture(scope="session")
def helm() -> Path:
    fetched = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "tools" / "fetch_helm.py")],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(fetched.stdout.strip())


@pytest.fixture(scope="session")
def kubernetes_validate() -> Path:
    return Path(sys.executable).parent / "kubernetes-validate"


@pytest.fixture(scope="session")
def render(helm) -> Callable[..., subprocess.CompletedProcess]:
    """`helm template` of the chart with values files (and `--set`s): the finished
    process, for the manifests (stdout) or the refusal (stderr)."""

    def run(*values: Path, sets: tuple[str, ...] = (), chart: Path = CHART):
        arguments = [str(helm), "template", RELEASE, str(chart)]
        arguments += [f"--values={path}" for path in values]
        arguments += [f"--set={item}" for item in sets]
        return subprocess.run(arguments, capture_output=True, text=True)

    return run


def manifests(rendered: subprocess.CompletedProcess) -> list[dict]:
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
