"""API keys: the key file, looking a presented key up, and reloading the file while the
server runs.

The file holds one key a line (blank lines and lines starting with `#` are skipped):

    NAME:KEY[:LIMITS]              the key itself (16+ printable characters, no `:`)
    NAME:sha256:HEX[:LIMITS]       its SHA-256, 64 hex digits (the key never on disk)
    LIMITS = max_concurrent=N,tokens_per_minute=N   either or both; 0: no limit

NAME (letters, digits, `_ . -`) is what logs, metrics and session records show; a key
itself is never written anywhere. A line without a limit takes the server's default.

Every key is held as its SHA-256 and a presented key is compared with each one by
`hmac.compare_digest`, so neither the comparison's time nor the memory holds a key.
`KeyFile` reloads the file on SIGHUP and when its modification time, size or inode
changes (checked every `poll_s`); a reload that fails keeps the keys already loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import signal
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger("hydra_jury.auth")

KEY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PLAIN_KEY = re.compile(r"[\x21-\x39\x3b-\x7e]{16,}")  # printable ASCII but `:`, no spaces
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
POLL_S = 2.0  # how often a running server looks for a changed key file
LINE_FORMS = "NAME:KEY, NAME:sha256:HEX, each optionally followed by :LIMITS"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and the line (never a
    key)."""


@dataclass(frozen=True)
class KeyLimits:
    """What one key may use at once; None: no limit."""

    max_concurrent: int | None = None  # generations in progress
    tokens_per_minute: int | None = None  # generated tokens in any 60 s

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or unset: no limit), got {value}")


NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the key
    limits: KeyLimits = NO_LIMITS


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeySet:
    """The keys of one version of the file."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    @property
    def names(self) -> list[str]:
        return [key.name for key in self.keys]

    def find(self, presented: str) -> ApiKey | None:
        """The key `presented` is, or None. Every key is compared, in constant time."""
        digest, found = key_digest(presented), None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def parse_key_file(text: str, where: str, defaults: KeyLimits = NO_LIMITS) -> KeySet:
    """The keys of a key file's `text`; `KeyFileError` naming `where` and the line."""
    keys: list[ApiKey] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = _parse_line(line, defaults)
        except ValueError as error:
            raise KeyFileError(f"{where} line {number}: {error}") from None
        if key.name in names:
            raise KeyFileError(f"{where} line {number}: the name {key.name!r} is given twice")
        if key.digest in digests:
            raise KeyFileError(
                f"{where} line {number}: key {key.name!r} is the same key as an earlier line's"
            )
        names.add(key.name)
        digests.add(key.digest)
        keys.append(key)
    if not keys:
        raise KeyFileError(f"{where} holds no keys ({LINE_FORMS}, one a line)")
    return KeySet(keys)


def _parse_line(line: str, defaults: KeyLimits) -> ApiKey:
    """One line's key. Messages never quote the line: it holds a key."""
    name, *rest = line.split(":")
    if not KEY_NAME.fullmatch(name):
        raise ValueError(
            f"expected {LINE_FORMS}; a name is 1-64 letters, digits or the characters _ . -"
        )
    if rest[:1] == ["sha256"] and len(rest) in (2, 3):
        hex_digest, limits = rest[1], rest[2:]
        if not SHA256_HEX.fullmatch(hex_digest):
            raise ValueError(f"key {name!r}: a sha256 key needs 64 hex digits")
        digest = bytes.fromhex(hex_digest)
    elif len(rest) in (1, 2):
        plain, limits = rest[0], rest[1:]
        if not PLAIN_KEY.fullmatch(plain):
            raise ValueError(
                f"key {name!r}: a key is at least 16 printable ASCII characters without "
                "spaces or ':'"
            )
        digest = key_digest(plain)
    else:
        raise ValueError(f"key {name!r}: expected {LINE_FORMS}")
    return ApiKey(name, digest, _parse_limits(limits[0], defaults) if limits else defaults)


def _parse_limits(text: str, defaults: KeyLimits) -> KeyLimits:
    """`max_concurrent=N,tokens_per_minute=N` over the defaults (0: no limit)."""
    known = ("max_concurrent", "tokens_per_minute")
    values: dict[str, int | None] = {}
    for item in text.split(","):
        name, equals, number = item.strip().partition("=")
        if name not in known or not equals or not number.strip().isdigit():
            raise ValueError(f"limits are {', '.join(f'{k}=N' for k in known)} (0: no limit)")
        values[name] = int(number) or None
    return replace(defaults, **values)


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is rewritten or replaced (a Kubernetes Secret volume
    swaps a symlink: a new inode); None when it cannot be read."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


class KeyFile:
    """The keys of a key file, kept current while the server runs (`watch`)."""

    def __init__(
        self, path: str | Path, defaults: KeyLimits = NO_LIMITS, poll_s: float = POLL_S
    ) -> None:
        """Reads the file: `KeyFileError` when it cannot be read or used. `defaults`: the
        limits of a line that sets none; `poll_s`: how often `watch` looks for a change."""
        self.path, self.defaults, self.poll_s = Path(path), defaults, poll_s
        self._signature = _signature(self.path)
        self.keys = self._read()
        self._watcher: asyncio.Task | None = None
        self._on_signal = False

    def _read(self) -> KeySet:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise KeyFileError(f"API key file {self.path} cannot be read: {error}") from None
        return parse_key_file(text, f"API key file {self.path}", self.defaults)

    def reload(self) -> bool:
        """Reads the file again; on failure keeps the keys loaded and logs why. Whether
        the keys were replaced."""
        self._signature = _signature(self.path)
        try:
            keys = self._read()
        except KeyFileError as error:
            log.error("%s; keeping the %d keys loaded before", error, len(self.keys.keys))
            return False
        before, after = set(self.keys.names), set(keys.names)
        self.keys = keys
        log.info(
            "reloaded %s: %d keys (added %s, removed %s)",
            self.path,
            len(after),
            ", ".join(sorted(after - before)) or "none",
            ", ".join(sorted(before - after)) or "none",
        )
        return True

    def watch(self) -> None:
        """Reloads on SIGHUP and whenever the file changes, on the running event loop,
        until `stop_watching`."""
        loop = asyncio.get_running_loop()
        # Signal handlers can only be set from the main thread; servers started on a
        # background loop (the tests) are reloaded by the file check alone.
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            self._on_signal = True

        async def poll_forever() -> None:
            while True:
                await asyncio.sleep(self.poll_s)
                if _signature(self.path) != self._signature:
                    self.reload()

        self._watcher = loop.create_task(poll_forever())

    async def stop_watching(self) -> None:
        if self._on_signal:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._on_signal = False
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
