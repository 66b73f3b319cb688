"""Installing a fetched tool binary into var/tools once, for deploy/tools/fetch_*.py."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path


def install_once(dest: Path, fetch: Callable[[Path], bytes]) -> Path:
    """`dest`, unless it is there already: the bytes `fetch(scratch)` gives (working in
    the temporary folder `scratch`), made executable. Written beside `dest` and renamed:
    a run cut short leaves no half binary that the next run would take for a finished
    one."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        binary = fetch(Path(scratch))
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(dest)
    return dest
