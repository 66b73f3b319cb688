"""`make fuzz`: the fuzz tests (tests/test_fuzz.py) with many more examples than `make
test` runs: every RPC of every service, the tensor codec and the session record decoder.
Bounded: `--examples` per test (hypothesis stops there), so it ends by itself.

    .venv/bin/python -m tools.fuzz [--examples 500] [pytest arguments...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tests.test_fuzz import EXAMPLES_VARIABLE

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__)
    parser.add_argument("--examples", type=int, default=500, help="per test (%(default)s)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    env = dict(os.environ, **{EXAMPLES_VARIABLE: str(args.examples)})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_fuzz.py"]
    return subprocess.run([*command, *pytest_args], cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
