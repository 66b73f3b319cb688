"""The chart's tools: helm (fetched once into var/tools by deploy/tools/fetch_helm.py),
promtool (by deploy/tools/fetch_promtool.py) and kubernetes-validate (the dev extra),
and a renderer of the chart."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "hydra-jury"
RELEASE = "hj"
# Set (CI sets it) to fail, not skip, the alert tests on a machine without promtool.
REQUIRE_PROMTOOL = "HYDRA_JURY_REQUIRE_PROMTOOL"


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
def promtool() -> Path:
    """Prometheus' promtool, from Debian's package: the tests that need it skip, saying
    why, where apt cannot fetch it (another distribution, no apt lists), unless
    $HYDRA_JURY_REQUIRE_PROMTOOL is 1."""
    fetched = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "tools" / "fetch_promtool.py")],
        capture_output=True,
        text=True,
    )
    if fetched.returncode != 0:
        reason = f"no promtool: {fetched.stderr.strip()}"
        if os.environ.get(REQUIRE_PROMTOOL) == "1":
            pytest.fail(f"{reason} (and ${REQUIRE_PROMTOOL}=1)")
        pytest.skip(reason)
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


def refusal(render: Callable[..., subprocess.CompletedProcess], folder: Path, values: dict) -> str:
    """What helm says refusing to render the chart with `values` (written into
    `folder`); the test fails if it renders."""
    path = folder / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = render(path)
    assert result.returncode != 0, f"rendered with {values}"
    return result.stderr
