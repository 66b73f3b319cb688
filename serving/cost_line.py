"""A cost measured against a size: seconds ≈ fixed + per_position · positions, fitted by
exponentially decayed least squares, so that it follows the machine as its load changes.
The automatic drafter fits its rounds' costs with it (`orchestrator.auto`), a batcher its
batches' (`serving.batcher`); and a batch's time is shared among its calls by it
(`batch_shares`)."""

from __future__ import annotations


class LinearCost:
    """seconds ≈ fixed + per_position · positions, by decayed least squares."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.sizes: set[int] = set()

    def observe(self, positions: int, seconds: float, decay: float | None = None) -> None:
        """One measurement; `decay` (default: the line's own) is how much every earlier
        one weighs from now on."""
        d = self.decay if decay is None else decay
        self.w = d * self.w + 1
        self.x = d * self.x + positions
        self.y = d * self.y + seconds
        self.xx = d * self.xx + positions * positions
        self.xy = d * self.xy + positions * seconds
        self.sizes.add(positions)

    @property
    def known(self) -> bool:
        return bool(self.sizes)

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_position), once two sizes were seen; None before."""
        if len(self.sizes) < 2:
            return None
        variance = self.xx / self.w - (self.x / self.w) ** 2
        if variance <= 1e-12:
            return None
        slope = (self.xy / self.w - (self.x / self.w) * (self.y / self.w)) / variance
        slope = max(slope, 0.0)
        return max(self.y / self.w - slope * self.x / self.w, 1e-6), slope

    def mean(self) -> float:
        return self.y / self.w


def batch_shares(
    seconds: float, positions: list[int], line: tuple[float, float] | None
) -> list[float]:
    """Each call's share of a batch that took `seconds` for calls of `positions`: what the
    call costs the server's throughput. With the batch's cost line (fixed, per_position),
    a call bears the fixed cost divided among the calls and its own positions' cost — so
    one more position costs a call what it costs the batch, which every call of it waits
    for — scaled so that the shares add up to the measured time. Without a line, shares
    in proportion to the positions. A lone call bears the whole batch."""
    total = sum(positions)
    if len(positions) == 1 or total == 0:
        return [seconds / len(positions)] * len(positions)
    if line is None:
        return [seconds * p / total for p in positions]
    fixed, per_position = line
    modelled = [fixed / len(positions) + per_position * p for p in positions]
    scale = seconds / sum(modelled)
    return [scale * m for m in modelled]
