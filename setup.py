"""Build hook and package map.

- The project's top-level folders (`poe/`, `orchestrator/`, ...) install as subpackages of
  one namespace, `hydra_jury` (`hydra_jury.poe`, `hydra_jury.orchestrator`, ...), so the
  wheel claims no generic top-level name such as `protos` or `workers`.
- The gRPC code is generated from `protos/hydrajury/v1/*.proto` while building, so that
  `pip install .`, wheels and sdists carry it without `make protos` (the generated code is
  never committed).

Everything else is declared in pyproject.toml."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
NAMESPACE = "hydra_jury"
# The folders that make up the installed package; bench/ and tests/ are not installed.
FOLDERS = (
    "protos",
    "kernels",
    "poe",
    "hydra_model",
    "workers",
    "serving",
    "trunk_service",
    "jury_service",
    "orchestrator",
    "cli",
)
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


def package_map() -> tuple[list[str], dict[str, str]]:
    """Every package under the namespace, and the folder each top-level one comes from."""
    packages, package_dir = [], {}
    for folder in FOLDERS:
        package_dir[f"{NAMESPACE}.{folder}"] = folder
        packages += [f"{NAMESPACE}.{folder}"]
        packages += [f"{NAMESPACE}.{folder}.{name}" for name in find_namespace_packages(folder)]
    return packages, package_dir


def generate_protos(out_dir: Path) -> None:
    """Writes the generated modules into `out_dir`/protos/hydrajury/v1 (what `make protos`
    does with the project root as `out_dir`).

    The project root is mapped to the import path `hydra_jury/`, so that the .proto files
    import each other as `hydra_jury/protos/hydrajury/v1/*.proto` and the generated modules
    as `hydra_jury.protos.hydrajury.v1.*`, their installed names."""
    # Imported here: grpcio-tools is a build requirement, not needed to read this file.
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as staging:
        arguments = [
            "grpc_tools.protoc",
            f"--proto_path={NAMESPACE}={ROOT}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            *(str(ROOT / proto) for proto in proto_files()),
        ]
        if protoc.main(arguments) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR}/*.proto (arguments: {arguments})")
        target = out_dir / PROTO_DIR
        target.mkdir(parents=True, exist_ok=True)
        for generated in (Path(staging) / NAMESPACE / PROTO_DIR).iterdir():
            shutil.copyfile(generated, target / generated.name)


class BuildPyWithProtos(build_py):
    """Wheels get freshly generated code in the build directory; an editable install
    imports from the source tree, so there the code is generated in place (what
    `make protos` does)."""

    def run(self) -> None:
        super().run()
        generate_protos(ROOT if self.editable_mode else Path(self.build_lib) / NAMESPACE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        # Listed even before the first build, when the source tree has no generated code.
        outputs = super().get_outputs(include_bytecode)
        generated = [str(path) for path in generated_files(Path(self.build_lib) / NAMESPACE)]
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


if __name__ == "__main__":  # pip's build backend runs this file as __main__
    packages, package_dir = package_map()
    setup(
        packages=packages,
        package_dir=package_dir,
        cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithProtos},
    )
