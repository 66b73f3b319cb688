"""The lock: every package of the development, test and CI environment at an exact version.

`requirements.lock` is a pip constraints file. `make setup` (and so `make test` and CI) and
the container image install with `-c requirements.lock`: a package is installed only when the
project or another package requires it, and then only at its locked version. Why
constraints rather than a pip-tools or uv lock: they need no tool beyond pip, pip takes
PyTorch's CPU build from the machine's local files (uv does not look there), and one file
serves both the development environment and the image, which installs a subset of it.
`pyproject.toml` keeps ranges, so `pip install .` does not over-pin a library's users;
`make test-latest` tests the newest versions those ranges admit.

    make lock       # the newest versions pyproject.toml admits, resolved afresh, written here

A local version label is dropped (torch 2.13.0+cpu is locked as 2.13.0), so that the CPU
build and the CUDA build the image may take both satisfy the lock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
PROJECT = "hydra-jury"  # the project itself is never locked
HEADER = """\
# hydra-jury's development, test and CI environment: every package at an exact version,
# resolved for Python {python} on Linux {machine}. A pip constraints file, used by
# `make setup`, `.ci/run` and the container image. Written by `make lock` (tools/lock.py);
# do not edit by hand.
"""


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """The locked versions by canonical package name."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, separator, version = line.partition("==")
        if not separator:
            raise ValueError(f"{path}: {line!r} is not a pin (name==version)")
        pins[canonicalize_name(name)] = version
    return pins


def render(pins: dict[str, str], python: str, machine: str) -> str:
    body = "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
    return HEADER.format(python=python, machine=machine) + body


def installed(python: str) -> dict[str, str]:
    """The distributions in the environment of the interpreter `python` (pip, setuptools and
    the build tools included; the project left out), their local labels dropped."""
    listing = subprocess.run(
        [python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {
        canonicalize_name(entry["name"]): Version(entry["version"]).public
        for entry in json.loads(listing)
        if canonicalize_name(entry["name"]) != PROJECT
    }


def interpreter(python: str) -> tuple[str, str]:
    """The Python version (major.minor) and machine of the interpreter `python`."""
    script = "import platform; print(platform.python_version(), platform.machine())"
    out = subprocess.run([python, "-c", script], check=True, capture_output=True, text=True)
    version, machine = out.stdout.split()
    return ".".join(version.split(".")[:2]), machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter of the resolved environment to lock (default: this one)",
    )
    parser.add_argument("--out", type=Path, default=LOCK, help=f"default: {LOCK.name}")
    args = parser.parse_args(argv)
    pins = installed(args.python)
    python, machine = interpreter(args.python)
    args.out.write_text(render(pins, python, machine))
    print(f"{args.out}: {len(pins)} packages locked (Python {python}, {machine})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
