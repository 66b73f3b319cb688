"""The native kernels (kernels.cpp): built with the machine's C++ compiler on first use and
kept in a cache keyed by their sources and the PyTorch build, then loaded as PyTorch
operators (`torch.ops.hydra_jury.*`).

`make setup` builds them (`python -m hydra_jury.kernels`), so a first request
does not wait for the compiler. Without them — another architecture, no compiler,
`HYDRA_JURY_KERNELS=off` — every product falls back to PyTorch's own (`products`), and so
does every pass over the vocabulary (`poe.row_kernels`), with a warning naming the reason:
slower, never wrong.

Environment:
    HYDRA_JURY_KERNELS=off      PyTorch's operations only (benchmarks compare the two)
    HYDRA_JURY_KERNEL_CACHE     where built libraries are kept
                                (default: $XDG_CACHE_HOME or ~/.cache, then hydra-jury/kernels)
    CXX                         the compiler (default: g++)
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (
    "kernels.cpp",
    "lanes_scalar.h",
    "lanes_avx2.h",
    "lanes_avx512.h",
    "rows_times_weight.h",
    "attention.h",
    "vocabulary.h",
    "gates.h",
)
INSTRUCTION_SETS = ("scalar", "avx2", "avx512")


class KernelBuildError(RuntimeError):
    """The native kernels could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    if "HYDRA_JURY_KERNEL_CACHE" in os.environ:
        return Path(os.environ["HYDRA_JURY_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hydra-jury" / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compile_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    return [
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        # at::parallel_for is OpenMP in PyTorch's headers: without it, one thread. The rpath
        # makes libgomp PyTorch's own (the same soname), not a second runtime.
        "-fopenmp",
        # Multiply-adds are fused only where the code says so (fma, std::fmaf): the same
        # results on every instruction set, whatever the compiler would contract.
        "-ffp-contract=off",
        "-w",  # PyTorch's headers warn under -std=c++20
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
    ]


def library_path() -> Path:
    """Where the library for these sources, flags, PyTorch and compiler lives."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join([_compiler(), *_compile_flags(), torch.__version__]).encode())
    return cache_dir() / f"hydra_jury_kernels-{digest.hexdigest()[:16]}.so"


def build(path: Path) -> Path:
    """Compiles the kernels into `path` (written whole, then moved into place, so a
    concurrent build or load never sees half a file)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelBuildError(f"the kernels are written for x86-64, not {platform.machine()}")
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: {compiler!r} is not on PATH (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as staging:
        target = Path(staging) / path.name
        source = str(SOURCE_DIR / "kernels.cpp")
        command = [compiler, *_compile_flags(), source, "-o", str(target), "-lc10", "-ltorch_cpu"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(
                f"{compiler} failed (exit {result.returncode}):\n{result.stderr[-4000:]}"
            )
        os.replace(target, path)
    return path


_state: dict[str, object] = {}


def native():
    """`torch.ops.hydra_jury`, built and loaded on first call; None when the kernels are
    off or cannot be had here (the reason is logged once)."""
    if "ops" not in _state:
        _state["ops"] = None
        if os.environ.get("HYDRA_JURY_KERNELS", "on").lower() in ("off", "0", "false", "no"):
            _state["reason"] = "HYDRA_JURY_KERNELS=off"
        else:
            try:
                _state["ops"] = load()
            except (KernelBuildError, OSError, RuntimeError) as error:
                _state["reason"] = str(error)
                log.warning("native kernels unavailable, using PyTorch's operations: %s", error)
    return _state["ops"]


def unavailable_reason() -> str | None:
    """Why `native()` is None (None when the kernels are loaded or not yet asked for)."""
    return _state.get("reason")


def load():
    """Builds the library if this cache has none for these sources, loads it, returns
    its operators. Raises KernelBuildError."""
    path = library_path()
    if not path.is_file():
        build(path)
    torch.ops.load_library(str(path))
    return torch.ops.hydra_jury


def instruction_set(requested: str = "") -> str:
    """The instruction set the kernels run with; `requested` switches it (tests compare
    every set bit for bit). Needs the kernels."""
    ops = native()
    if ops is None:
        raise KernelBuildError(f"native kernels unavailable: {unavailable_reason()}")
    return ops.kernel_isa(requested)


def main() -> None:
    """`make setup`: builds the kernels now and says where, or fails loudly."""
    try:
        ops = load()
    except (KernelBuildError, OSError, RuntimeError) as error:
        sys.exit(f"hydra-jury kernels: {error}")
    print(f"hydra-jury kernels: {library_path()} ({ops.kernel_isa('')})")
