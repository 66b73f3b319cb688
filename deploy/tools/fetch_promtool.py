"""Puts Prometheus' `promtool` at var/tools/promtool (once; nothing to do when it is
there), for the chart's alert tests (`promtool check rules`, `promtool test rules`).

Debian's `prometheus` package ships it (a static Go binary, usr/bin/promtool; 19 MB).
`apt-get download` fetches the package from the machine's own apt sources, as root or
not, without installing it (no Prometheus server is set up, nothing outside the
repository changes), and `dpkg-deb -x` unpacks it. So nothing here names a host.

    python deploy/tools/fetch_promtool.py [--dest var/tools/promtool]

Exits non-zero with a one-line reason when it cannot: no apt-get or dpkg-deb (not a
Debian-like machine), or the download failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

# this folder is on the path of `python deploy/tools/...`
from binaries import install_once

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / "var" / "tools" / "promtool"
PACKAGE = "prometheus"
PROMTOOL_IN_PACKAGE = "usr/bin/promtool"


class FetchError(RuntimeError):
    """promtool cannot be had on this machine; the message says why."""


def run(command: list[str], cwd: Path) -> None:
    if shutil.which(command[0]) is None:
        raise FetchError(f"{command[0]} is not installed: promtool comes from a Debian package")
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        # apt-get's own words: an unknown package, no network, no apt lists.
        reason = (result.stderr or result.stdout).strip().splitlines()
        said = reason[-1] if reason else f"exit status {result.returncode}"
        hint = " (no apt lists? `apt-get update` first)" if command[0] == "apt-get" else ""
        raise FetchError(f"{' '.join(command)} failed: {said}{hint}")


def promtool_from_package(scratch: Path) -> Path:
    """Downloads the package into `scratch` and unpacks it there; promtool's path."""
    # apt-get download writes into the working directory. As root, apt drops to its
    # _apt user, which cannot write a private temporary folder: it says so in a
    # warning and downloads as root instead.
    run(["apt-get", "download", "--quiet", PACKAGE], cwd=scratch)
    (deb,) = scratch.glob(f"{PACKAGE}_*.deb")
    run(["dpkg-deb", "-x", str(deb), str(scratch / "root")], cwd=scratch)
    promtool = scratch / "root" / PROMTOOL_IN_PACKAGE
    if not promtool.is_file():
        raise FetchError(f"{deb.name} holds no {PROMTOOL_IN_PACKAGE}")
    return promtool


def fetch_promtool(dest: Path = DEFAULT_DEST) -> Path:
    """The path of the promtool binary, downloaded and unpacked unless already there."""
    return install_once(dest, lambda scratch: promtool_from_package(scratch).read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    try:
        print(fetch_promtool(parser.parse_args().dest))
    except FetchError as error:
        sys.exit(f"fetch_promtool: {error}")


if __name__ == "__main__":
    main()
