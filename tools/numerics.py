"""`make test-numerics`: the tests whose outcome could depend on PyTorch's float path (marked
`numerics`: the statistical tests, the poisoned-head test, the tests of trained models'
quality) under every CPU capability this machine supports and with 1 and 2 threads.

PyTorch picks its vectorized kernels by the CPU's capability (`default`, `avx2`, `avx512` on
x86), and `ATEN_CPU_CAPABILITY` lowers it: a machine with AVX-512 can run every float path a
machine without it takes. Each configuration runs in a fresh pytest process, and its
report header (tests/environment.py) shows that the capability took effect. The
configurations of one thread count run side by side, as many at once as their threads
fit in the cores (on 2 cores: the two 1-thread runs together, then each 2-thread run).

    .venv/bin/python -m tools.numerics [--capabilities default,avx2] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.environment import THREADS_VARIABLE

REPO = Path(__file__).resolve().parents[1]
# x86's capabilities, lowest first; a machine supports every one up to its own.
LADDER = ("default", "avx2", "avx512")
THREADS = (1, 2)


def native_capability() -> str:
    """The capability PyTorch picks here when nothing lowers it, in lower case."""
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip().lower()


def supported_capabilities(native: str) -> list[str]:
    """Every capability up to `native` (`default` and the native one off x86)."""
    if native in LADDER:
        return list(LADDER[: LADDER.index(native) + 1])
    return ["default", native] if native != "default" else ["default"]


def run_configuration(
    capability: str, threads: int, pytest_args: list[str]
) -> tuple[bool, str, str]:
    """Runs the numerics tests once; (passed, a one-line summary, pytest's output)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS=str(threads))
    env[THREADS_VARIABLE] = str(threads)
    # Not -q: the report header shows the float path the run took.
    command = [sys.executable, "-m", "pytest", "-m", "numerics", "-p", "no:cacheprovider"]
    started = time.monotonic()
    result = subprocess.run(
        command + pytest_args, cwd=REPO, env=env, capture_output=True, text=True
    )
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    header = re.search(r"torch float path: capability (\w+), threads (\d+)", output)
    took_effect = (
        header is not None
        and header.group(1).lower() == capability
        and int(header.group(2)) == threads
    )
    lines = output.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "no output"
    if not took_effect:
        found = header.group(0) if header else "no report header"
        summary = f"the configuration did not take effect ({found}); {summary}"
    passed = result.returncode == 0 and took_effect
    return passed, f"{summary} [{seconds:.0f} s]", output


def side_by_side(threads: int) -> int:
    """How many runs of `threads` threads fit in the cores this process may use at once
    (a run's threads spin while they wait: more would slow every one)."""
    return max(1, len(os.sched_getaffinity(0)) // threads)


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.numerics",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--capabilities",
        type=parse_list,
        help="comma-separated; default: every one this machine supports",
    )
    parser.add_argument(
        "--threads",
        type=lambda text: [int(n) for n in parse_list(text)],
        default=list(THREADS),
        help="comma-separated thread counts (default: 1,2)",
    )
    args, pytest_args = parser.parse_known_args(argv)
    native = native_capability()
    supported = supported_capabilities(native)
    capabilities = args.capabilities or supported
    unsupported = [c for c in capabilities if c not in supported]
    if unsupported:
        parser.error(f"this CPU supports {', '.join(supported)}, not {', '.join(unsupported)}")
    print(
        f"numerics tests: capabilities {', '.join(capabilities)} (native {native}), "
        f"threads {', '.join(map(str, args.threads))}",
        flush=True,
    )
    failed = []
    for threads in args.threads:
        with ThreadPoolExecutor(side_by_side(threads)) as pool:
            runs = pool.map(
                run_configuration,
                capabilities,
                [threads] * len(capabilities),
                [pytest_args] * len(capabilities),
            )
            for capability, (passed, summary, output) in zip(capabilities, runs, strict=True):
                if not passed:
                    print(output, file=sys.stderr)
                    failed.append(f"{capability}/{threads}")
                print(f"{capability:>8}, {threads} thread(s): {summary}", flush=True)
    if failed:
        print(f"numerics tests failed under: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
