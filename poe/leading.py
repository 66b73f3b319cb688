"""The first entries of each row in descending order, as a stable sort orders them, found
without sorting the whole row.

A stable descending sort of a 49,152-token row took 4.6 ms, its 40 largest values by a
top-k 0.1 ms (2-core AMD EPYC, Zen 3). The sampling filters keep a leading run of each
row, and a beam search step walks the first 2·num_beams extensions of beams × V: both
take only the entries that can be among the first `count` — those at least the count-th
largest value, more where equal values straddle it — and sort those alone. Where that is
an eighth of the row or more, or off the CPU, the whole row is sorted.
"""

from __future__ import annotations

import torch

FULL_SORT_SHARE = 8


def leading(values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` entries of each row of `values` [N, W] in descending order, equal
    values in index order (as a stable sort orders them): their values and indices,
    [N, count]."""
    width = values.shape[1]
    # A GPU sorts a row in microseconds, and looking for ties would wait for it.
    if count * FULL_SORT_SHARE < width and values.device.type == "cpu":
        largest = values.topk(count + 1, dim=-1)
        reach = count
        if bool((largest.values[:, -1] == largest.values[:, -2]).any()):
            # Equal values straddle the count-th: every entry that can be among the first
            # `count` is one at least the count-th largest value.
            floor = largest.values[:, -2:-1]
            reach = max(count, int((values >= floor).sum(-1).max()))
        if reach * FULL_SORT_SHARE < width:
            ids = largest.indices[:, :count] if reach == count else values.topk(reach).indices
            ids = ids.sort(dim=-1).values  # index order, which the stable sort keeps
            first, by_value = values.gather(1, ids).sort(dim=-1, descending=True, stable=True)
            return first[:, :count], ids.gather(1, by_value)[:, :count]
    first, ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return first[:, :count], ids[:, :count]
