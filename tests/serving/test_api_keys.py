"""The API key file: its format (plain and hashed keys, limits, comments), errors that
name the line and never a key, constant-time lookup, and reloading — on a change of the
file, on SIGHUP, keeping the old keys when the new file is bad."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from hydra_jury.serving.api_keys import (
    KeyFile,
    KeyFileError,
    KeyLimits,
    key_digest,
    parse_key_file,
)

ALICE = "alice-key-0123456789"
BOB = "bob-key-9876543210ab"


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_plain_and_hashed_keys_with_comments_and_limits():
    text = f"""
# operators
alice:{ALICE}
  bob:sha256:{sha256_hex(BOB)}:max_concurrent=2

carol:sha256:{sha256_hex("carol-key-aaaaaaaaaaaa").upper()}:tokens_per_minute=0,max_concurrent=1
"""
    defaults = KeyLimits(max_concurrent=4, tokens_per_minute=600)
    keys = parse_key_file(text, "keys.txt", defaults)
    assert keys.names == ["alice", "bob", "carol"]
    assert keys.find(ALICE).limits == defaults
    assert keys.find(BOB).limits == KeyLimits(max_concurrent=2, tokens_per_minute=600)
    # 0 lifts a default: no limit for this key.
    assert keys.find("carol-key-aaaaaaaaaaaa").limits == KeyLimits(max_concurrent=1)
    assert keys.find("wrong-key-0000000000") is None
    assert keys.find("") is None
    assert keys.find(ALICE).digest == key_digest(ALICE)
    assert ALICE not in repr(keys.find(ALICE))  # the digest is not in its repr either


MALFORMED = {
    "no key": ("alice", "line 2: key 'alice': expected NAME:KEY"),
    "a bad name": (f"al ice:{ALICE}", "line 2: expected NAME:KEY"),
    "a short key": ("alice:short", "line 2: key 'alice': a key is at least 16"),
    "a short hash": ("alice:sha256:abc", "line 2: key 'alice': a sha256 key needs 64 hex"),
    "an unknown limit": (f"alice:{ALICE}:rate=3", "line 2: limits are max_concurrent=N"),
    "a limit without a number": (f"alice:{ALICE}:max_concurrent=x", "line 2: limits are"),
    "too many fields": (f"alice:{ALICE}:max_concurrent=1:extra", "line 2: key 'alice'"),
    "a name twice": (f"alice:{BOB}\nalice:{ALICE}", "line 3: the name 'alice' is given twice"),
    "one key twice": (
        f"alice:{ALICE}\nbob:sha256:{sha256_hex(ALICE)}",
        "line 3: key 'bob' is the same key as an earlier line's",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_line_is_named_without_its_key(case):
    line, message = MALFORMED[case]
    with pytest.raises(KeyFileError) as raised:
        parse_key_file(f"# keys\n{line}\n", "keys.txt")
    assert str(raised.value).startswith("keys.txt ") and message in str(raised.value)
    for secret in (ALICE, BOB, "short", sha256_hex(ALICE)):
        assert secret not in str(raised.value)


def test_a_file_without_keys_is_refused(tmp_path):
    with pytest.raises(KeyFileError, match="holds no keys"):
        parse_key_file("# nobody yet\n\n", "keys.txt")
    with pytest.raises(KeyFileError, match="cannot be read"):
        KeyFile(tmp_path / "missing")


def key_file(tmp_path: Path, poll_s: float) -> tuple[Path, KeyFile]:
    """A key file holding alice's key, and its `KeyFile` looking for changes every
    `poll_s`."""
    path = tmp_path / "keys"
    path.write_text(f"alice:{ALICE}\n")
    return path, KeyFile(path, poll_s=poll_s)


def while_watched(keys: KeyFile, scenario: Callable[[], Awaitable[None]]) -> None:
    async def run() -> None:
        keys.watch()
        try:
            await scenario()
        finally:
            await keys.stop_watching()

    asyncio.run(run())


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_old_keys(tmp_path, caplog):
    path, keys = key_file(tmp_path, poll_s=0.02)

    async def scenario() -> None:
        path.write_text(f"bob:{BOB}\n")
        await wait_until(lambda: keys.keys.find(BOB) is not None)
        assert keys.keys.find(ALICE) is None  # revoked
        path.write_text(f"bob:{BOB}\nbroken line\n")
        await wait_until(lambda: "keeping the 1 keys loaded before" in caplog.text)
        assert keys.keys.names == ["bob"]

    with caplog.at_level(logging.INFO, logger="hydra_jury.auth"):
        while_watched(keys, scenario)
    assert "line 2" in caplog.text and "added bob, removed alice" in caplog.text
    assert ALICE not in caplog.text and BOB not in caplog.text


def test_sighup_reloads_the_file(tmp_path):
    """Run on the main thread (signal handlers need it), with a poll too slow to count."""
    path, keys = key_file(tmp_path, poll_s=3600)

    async def scenario() -> None:
        path.write_text(f"bob:{BOB}\n")
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until(lambda: keys.keys.names == ["bob"])

    while_watched(keys, scenario)


def test_a_file_is_not_watched_after_stop_watching(tmp_path):
    path, keys = key_file(tmp_path, poll_s=0.01)

    async def scenario() -> None:
        keys.watch()
        await keys.stop_watching()
        path.write_text(f"bob:{BOB}\n")
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert keys.keys.names == ["alice"]


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")
