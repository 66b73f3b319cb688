"""Preallocated key/value caches.

Terms
- component: the trunk, or a stack of S heads evaluated together.
- slot: one session's share of a pool; a pool preallocates `num_slots` of them so the
  memory of a service is bounded and known up front, and so that a later batched
  forward over several sessions can index the pool by a list of slots.
- length: how many positions of a slot hold valid keys/values. Rolling back is moving
  the length (`truncate`); stale entries beyond it are simply overwritten later.

Layout of a pool: keys/values [num_slots, S, layers, kv_heads, capacity, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheError(RuntimeError):
    """A cache used out of order (wrong start position, over capacity, no free slot)."""


class KVCache:
    """One session's cache for one component: a view of a pool slot plus its length."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: int = 0) -> None:
        self.keys = keys  # [S, layers, kv_heads, capacity, head_dim]
        self.values = values
        self.slot = slot
        self.length = 0
        # Views of members' keys and values, made once (`members`: every round of a jury
        # asks for the same ones, and a view costs as much to make as a small product).
        self._member_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def truncate(self, length: int) -> None:
        """Forgets every position >= length. No data moves."""
        if not 0 <= length <= self.length:
            raise CacheError(
                f"cannot truncate a cache of length {self.length} to {length}: "
                f"the new length must be between 0 and the current length"
            )
        self.length = length

    def check_append(self, start: int, count: int) -> None:
        if start != self.length:
            raise CacheError(
                f"append at position {start} but the cache holds {self.length} positions; "
                f"truncate to {start} first (or prefill the missing positions)"
            )
        if start + count > self.capacity:
            raise CacheError(
                f"appending {count} positions at {start} exceeds the cache capacity "
                f"of {self.capacity} positions"
            )

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores keys/values [S, kv_heads, T, hd] at start..start+T-1 of `layer` and returns
        the valid prefix [S, kv_heads, start+T, hd] to attend over. The length moves in
        `advance`, once every layer has written."""
        end = start + keys.shape[2]
        self.keys[:, layer, :, start:end] = keys
        self.values[:, layer, :, start:end] = values
        return self.keys[:, layer, :, :end], self.values[:, layer, :, :end]

    def advance(self, count: int) -> None:
        self.length += count

    def members(self, members: slice, length: int) -> KVCache:
        """The cache of some members of this stack, holding `length` positions: a view,
        so what a forward appends lands in this slot. Heads of one stack evaluated on
        demand each hold their own number of positions (`workers.jury`)."""
        key = (members.start, members.stop)
        if key not in self._member_views:
            self._member_views[key] = (self.keys[members], self.values[members])
        view = KVCache(*self._member_views[key], self.slot)
        if not 0 <= length <= self.capacity:
            raise CacheError(f"a cache of capacity {self.capacity} cannot hold {length} positions")
        view.length = length
        return view


@dataclass(frozen=True)
class SlotBatch:
    """B new positions of some sessions, addressed on the device (what a CUDA graph can
    replay for any sessions): the pool's keys and values [slots, S, layers, kv_heads,
    capacity, head_dim] (or a view of some members), each row's slot and position, long
    tensors [B] on the device, and how many positions of a slot the rows attend: more
    than any row's position, a shape the step is recorded at (`graphs.attended_span`)."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    span: int | None = None  # the positions attended, 0..span-1 (None: the capacity)


class KVCachePool:
    """A fixed number of preallocated slots for one component."""

    def __init__(
        self,
        *,
        num_slots: int,
        stack: int,
        layers: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots <= 0 or capacity <= 0:
            raise ValueError("a cache pool needs at least one slot and one position")
        shape = (num_slots, stack, layers, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[4]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def acquire(self) -> KVCache:
        if not self._free:
            raise CacheError(f"all {self.num_slots} cache slots are in use")
        slot = self._free.pop()
        return KVCache(self.keys[slot], self.values[slot], slot)

    def release(self, cache: KVCache) -> None:
        if cache.slot in self._free or not 0 <= cache.slot < self.num_slots:
            raise CacheError(f"slot {cache.slot} is not in use")
        cache.length = 0
        self._free.append(cache.slot)


def bytes_per_position(
    *, stack: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Cache memory one position of one session costs a component (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * stack * layers * kv_heads * head_dim * itemsize
