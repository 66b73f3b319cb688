"""Build hook: generates the gRPC code from `protos/hydrajury/v1/*.proto` while building,
so that `pip install .`, wheels and sdists carry it without `make protos` (the generated
code is never committed). Everything else is declared in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
PROTO_DIR = Path("protos/hydrajury/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files, relative to the project root (their import root)."""
    return sorted(path.relative_to(ROOT) for path in (ROOT / PROTO_DIR).glob("*.proto"))


def generated_files(out_dir: Path) -> list[Path]:
    return [
        out_dir / proto.parent / f"{proto.stem}{suffix}"
        for proto in proto_files()
        for suffix in GENERATED_SUFFIXES
    ]


def generate_protos(out_dir: Path) -> None:
    """The same command as `make protos`, writing under `out_dir` (the generated modules
    import each other as `protos.hydrajury.v1.*`, so the project root is the include
    root)."""
    # Imported here: grpcio-tools is a build requirement, not needed to read this file.
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    arguments = [
        "grpc_tools.protoc",
        f"--proto_path={ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / proto) for proto in proto_files()),
    ]
    if protoc.main(arguments) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR}/*.proto (arguments: {arguments})")


class BuildPyWithProtos(build_py):
    """Wheels get freshly generated code in the build directory; an editable install
    imports from the source tree, so there the code is generated in place (what
    `make protos` does)."""

    def run(self) -> None:
        super().run()
        generate_protos(ROOT if self.editable_mode else Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        # Listed even before the first build, when the source tree has no generated code.
        outputs = super().get_outputs(include_bytecode)
        generated = [str(path) for path in generated_files(Path(self.build_lib))]
        return outputs + [path for path in generated if path not in outputs]


class SdistWithProtos(sdist):
    """An sdist carries the generated code too (a wheel built from it generates it
    again)."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        # Code left by `make protos` is hard-linked into the release tree: unlinked first,
        # protoc would write through the link into the checkout.
        for path in generated_files(Path(base_dir)):
            path.unlink(missing_ok=True)
        generate_protos(Path(base_dir))


setup(cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithProtos})
