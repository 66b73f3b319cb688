"""What the gRPC backend's internal calls cost, for benchmarks: bytes each way, and time
on the client and (the slowest replica's) on the server, per phase of a round."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransportStats:
    """Bytes and server-side time of internal calls, for benchmarks."""

    bytes_sent: int = 0
    bytes_received: int = 0
    server_ns: dict[str, int] = field(default_factory=lambda: {"draft": 0, "score": 0})
    client_ns: dict[str, int] = field(default_factory=lambda: {"draft": 0, "score": 0})

    def record(
        self, phase: str, began_ns: int, requests: Sequence[Any], responses: Sequence[Any]
    ) -> None:
        """One phase's calls ("draft" or "score"), sent at `began_ns`
        (`time.perf_counter_ns`) and all answered now: their messages and the timings the
        services answered with. The calls ran concurrently, so the server time is the
        slowest's."""
        self.client_ns[phase] += time.perf_counter_ns() - began_ns
        self.server_ns[phase] += max(r.timings.total_ns for r in responses)
        self.bytes_sent += sum(r.ByteSize() for r in requests)
        self.bytes_received += sum(r.ByteSize() for r in responses)
