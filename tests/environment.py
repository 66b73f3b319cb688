"""What a test run's outcome can depend on besides the code: the CPU, the float path PyTorch
takes on it, its threads and the resolved versions of the key packages. Printed at the top of
every pytest run (tests/conftest.py) and by `.ci/run`, so that a red run says what differed
from a green one.

    .venv/bin/python -m tests.environment
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

KEY_PACKAGES = (
    "torch",
    "numpy",
    "scipy",
    "transformers",
    "tokenizers",
    "safetensors",
    "grpcio",
    "protobuf",
    "redis",
)
# The tests' torch threads (tests/conftest.py; 1 when unset): `make test-numerics` sets it.
THREADS_VARIABLE = "HYDRA_JURY_TEST_THREADS"
# The variables that choose PyTorch's float path or its threads, when set.
FLOAT_PATH_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    THREADS_VARIABLE,
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
)


def cpu_model() -> str:
    """The CPU's model name as lscpu shows it (from /proc/cpuinfo); the platform's
    processor string elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine()


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe() -> list[str]:
    """The lines that describe this machine and environment."""
    import torch  # imported here: reading /proc/cpuinfo must not need it

    settings = [f"{name}={os.environ[name]}" for name in FLOAT_PATH_VARIABLES if name in os.environ]
    return [
        f"cpu: {cpu_model()} ({os.cpu_count()} logical cores, {platform.machine()})",
        f"torch float path: capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {torch.get_num_threads()}; "
        f"{', '.join(settings) if settings else 'no float-path variables set'}",
        "packages: " + ", ".join(f"{name} {package_version(name)}" for name in KEY_PACKAGES),
        f"python: {platform.python_version()}",
    ]


if __name__ == "__main__":
    print("\n".join(describe()))
