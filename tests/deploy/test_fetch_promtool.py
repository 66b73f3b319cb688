"""deploy/tools/fetch_promtool.py where promtool cannot be had: a one-line reason and a
non-zero exit (which the `promtool` fixture turns into a skip, or a failure under
HYDRA_JURY_REQUIRE_PROMTOOL=1), and no half-written binary left behind. Where it can,
the alert tests use what it fetched (test_alerts.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.deploy.conftest import REPO

TOOL = REPO / "deploy" / "tools" / "fetch_promtool.py"


def fetch(dest: Path, path: Path) -> subprocess.CompletedProcess:
    """The tool with only `path` on $PATH."""
    return subprocess.run(
        [sys.executable, str(TOOL), f"--dest={dest}"],
        capture_output=True,
        text=True,
        env={"PATH": str(path)},
    )


def test_without_apt_it_says_so(tmp_path):
    result = fetch(tmp_path / "tools" / "promtool", tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "fetch_promtool: apt-get is not installed: promtool comes from a Debian package"
    )
    assert not (tmp_path / "tools").exists() or not any((tmp_path / "tools").iterdir())


def test_a_failed_download_says_why(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, message in {
        "apt-get": "E: Unable to locate package prometheus",
        "dpkg-deb": "not reached",
    }.items():
        script = bin_dir / tool
        script.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 100\n")
        script.chmod(0o755)
    dest = tmp_path / "tools" / "promtool"
    result = fetch(dest, bin_dir)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert "E: Unable to locate package prometheus" in line and "apt-get update" in line
    assert not dest.exists() and not dest.with_name("promtool.partial").exists()
