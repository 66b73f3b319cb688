"""Which replica holds which session's caches: the gRPC backend's bookkeeping, without
gRPC.

A session's caches live on one replica of each component (the trunk service, each jury
shard), named by address. A new session goes to the least loaded ready replica (by the
sessions placed here); a session whose record names a replica that is still ready goes
back to it. A replica that failed a call is a suspect for a while: new sessions avoid it
while another replica is ready, and the session whose call failed leaves it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# A replica that failed a call is avoided for new placements this long, while the
# discovery catches up.
SUSPECT_S = 10.0


class Placements:
    """Cache id -> component -> address, and the suspects; safe to share between the
    threads of concurrent requests. `clock` is `time.monotonic` (a test moves its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._placed: dict[str, dict[str, str]] = {}  # cache id -> component -> address
        self._suspects: dict[str, float] = {}  # address -> until when it is avoided

    def address(self, component: str, cache: str, ready: list[str], wanted: str = "") -> str:
        """The replica of `component`, among its `ready` addresses (at least one), that
        holds or will hold the caches named `cache`: where they are placed while it is
        ready, else `wanted` (a record's placement) while it is ready, else the least
        loaded replica that is not a suspect (any, if all are)."""
        with self._lock:
            placement = self._placed.setdefault(cache, {})
            address = placement.get(component) or wanted
            if address not in ready:
                now = self._clock()
                healthy = [a for a in ready if self._suspects.get(a, 0.0) < now] or ready
                load = {a: 0 for a in healthy}
                for placed in self._placed.values():
                    if placed.get(component) in load:
                        load[placed[component]] += 1
                address = min(healthy, key=lambda a: (load[a], a))
            placement[component] = address
        return address

    def placed(self, cache: str) -> dict[str, str]:
        """Where the caches named `cache` are placed: component -> address."""
        with self._lock:
            return dict(self._placed.get(cache, {}))

    def forget(self, cache: str) -> dict[str, str]:
        """Drops the placement of `cache` (its caches were released); returns it."""
        with self._lock:
            return self._placed.pop(cache, {})

    def suspect(self, address: str, component: str, cache: str) -> None:
        """The replica at `address` failed a call on the caches named `cache`: it is
        avoided for new placements for `SUSPECT_S`, and those caches leave it (the next
        call places them anew)."""
        with self._lock:
            self._suspects[address] = self._clock() + SUSPECT_S
            placement = self._placed.get(cache, {})
            if placement.get(component) == address:
                del placement[component]
