"""Decode steps replayed from CUDA graphs.

On a GPU, a decode step of a small model is bound by the host, not the device: each of
its few hundred kernels takes microseconds to run and longer to launch from Python (an
H100's 1B-class step: 408 kernels running for 1.6 ms, 105 ms eager, 1.8 ms replayed;
docs/gpu.md). A CUDA graph records the step's kernels once and replays them with one
launch. Recording needs a step whose shapes and memory never change and which reads
nothing back to the host: `forward_static` of the trunk and heads over a few positions
of some sessions, addressed by slot and position in device tensors (keys and values
written by index; attention over a span of each slot, `attended_span`, masked past the
row's position). Its inputs live in buffers the graph reads, its output in a buffer the
graph writes; one graph per step kind, batch size and span.

`HYDRA_JURY_CUDA_GRAPHS` chooses, when a step is made:
- `auto` (the default): the workers' steps of at most MAX_STATIC_ROWS rows replay from
  graphs on CUDA; elsewhere the ragged forward runs, as it always has;
- `off`: the ragged forward everywhere (a GPU then launches every kernel from Python);
- `eager`: the fixed-shape steps run eagerly on any device — the same arithmetic as the
  graphs without recording them, which is how the CPU's tests check it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable

import torch

from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.kv_cache import KVCache, KVCachePool, SlotBatch
from hydra_jury.hydra_model.trunk import Trunk

MODE_VARIABLE = "HYDRA_JURY_CUDA_GRAPHS"
MODES = ("auto", "off", "eager")
WARMUP_STEPS = 2  # eager runs on a side stream before recording: cuBLAS sets itself up
# The most rows (positions of all sessions of a call or batch) a fixed-shape step takes:
# a decode step, a speculative round's score, a batch of sessions' rounds. Beyond, a
# prefill, compute-bound, where launches cost little and every row would gather its
# slot's whole cache.
MAX_STATIC_ROWS = 64
MIN_SPAN = 64  # the fewest positions a step attends (`attended_span`)


def graph_mode(device: torch.device) -> str | None:
    """How the workers' steps of a few rows run on `device`: "graph", "eager" (fixed
    shapes, not recorded) or None (the ragged forward), from $HYDRA_JURY_CUDA_GRAPHS."""
    mode = os.environ.get(MODE_VARIABLE, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"${MODE_VARIABLE}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "eager":
        return "eager"
    if mode == "auto" and device.type == "cuda":
        return "graph"
    return None


def padded(count: int) -> int:
    """The batch size a step of `count` rows runs at: the next power of two, so that a few
    recorded graphs serve every count."""
    return 1 << (count - 1).bit_length()


def attended_span(length: int, capacity: int) -> int:
    """How many positions of their slots a step's rows attend when the longest holds
    `length` (its last row's position + 1): the next power of two, at least MIN_SPAN, at
    most the capacity. A step's attention then costs what the sessions hold, within a
    factor of two, with a few recorded shapes."""
    return min(capacity, max(MIN_SPAN, 1 << (length - 1).bit_length()))


def padded_rows(rows: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """`rows` (one per position) padded to `padded(len(rows))` by repeating the first: a
    repeated row writes its session's key and value again, the same ones, and its
    outputs are left out."""
    return rows + rows[:1] * (padded(len(rows)) - len(rows))


def padded_tensor(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] padded along its first dimension as `padded_rows` pads."""
    extra = padded(len(x)) - len(x)
    return x if not extra else torch.cat([x, x[:1].expand(extra, *x.shape[1:])])


def on_device(rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """Host integers, one tuple per row, as a long tensor [fields, rows] on `device`; on
    CUDA through pinned memory, the copy queued on the stream without waiting for it."""
    tensor = torch.tensor(rows, dtype=torch.long).T.contiguous()
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class StepGraph:
    """`function(*inputs) -> output` at fixed shapes, each input a static buffer shaped as
    its example. Replayed from a CUDA graph (recorded on the first call) or, with
    `graph=False`, run eagerly.

    The output of a replay is the graph's own buffer, overwritten by its next replay and
    possibly by another graph's of the same pool: copy what is kept."""

    def __init__(
        self,
        function: Callable[..., torch.Tensor],
        examples: list[torch.Tensor],
        *,
        graph: bool,
        pool: tuple | None = None,
    ) -> None:
        device = examples[0].device
        if graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; these inputs are on {device}")
        self.function = function
        self.graph = graph
        self._inputs = [torch.zeros_like(example) for example in examples]
        self._pool = pool
        self._recorded: torch.cuda.CUDAGraph | None = None
        self._output: torch.Tensor | None = None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for buffer, value in zip(self._inputs, inputs, strict=True):
            buffer.copy_(value)
        if not self.graph:
            return self.function(*self._inputs)
        if self._recorded is None:
            self._record()
        self._recorded.replay()
        return self._output

    def _record(self) -> None:
        # The warm-up runs compute this call's own step, and write its keys and values
        # at its own positions: the replay that follows writes the same ones again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.function(*self._inputs)
        torch.cuda.current_stream().wait_stream(side)
        recorded = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may use CUDA meanwhile (copies to the
        # host, pinned buffers); only this thread's own unsafe calls end the capture.
        with torch.cuda.graph(recorded, pool=self._pool, capture_error_mode="thread_local"):
            self._output = self.function(*self._inputs)
        self._recorded = recorded


class StepGraphs:
    """A worker's recorded steps by key (what runs, at which batch size and span). They
    share one memory pool, since they replay one at a time. The sessions' slots and
    positions are inputs, so a step serves any sessions of its batch size."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode = mode  # "graph" or "eager" (`graph_mode`)
        self.device = device
        self._pool = torch.cuda.graph_pool_handle() if mode == "graph" else None
        self._steps: dict[Hashable, StepGraph] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def run(
        self,
        key: tuple,
        make: Callable[[int], Callable[..., torch.Tensor]],
        rows: list[tuple[int, ...]],
        capacity: int,
        data: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rows` (one tuple of integers per position, the position last) and `data` (a
        tensor per position on the device: hidden states, tokens), padded as
        `padded_rows` pads, through the step of `key` at their batch size and at the span
        they attend (`attended_span` of `capacity`), made by `make(span)` on first use.
        The output holds the padded rows too, and is the step's own buffer (`StepGraph`):
        copy what is kept."""
        span = attended_span(max(row[-1] for row in rows) + 1, capacity)
        inputs = on_device(padded_rows(rows), self.device)
        given = [inputs] if data is None else [padded_tensor(data), inputs]
        full_key = (*key, inputs.shape[1], span)
        if full_key not in self._steps:
            graph = self.mode == "graph"
            self._steps[full_key] = StepGraph(make(span), given, graph=graph, pool=self._pool)
        return self._steps[full_key](*given)


def trunk_step(trunk: Trunk, pool: KVCachePool, span: int) -> Callable[..., torch.Tensor]:
    """(inputs [3, B]: tokens, slots, positions) -> the trunk's hidden states [B, D], each
    row over its slot of `pool`, attending `span` positions."""

    def run(inputs: torch.Tensor) -> torch.Tensor:
        tokens, slots, positions = inputs
        batch = SlotBatch(pool.keys, pool.values, slots, positions, span)
        return trunk.forward_static(tokens, batch)

    return run


def heads_step(
    heads: HeadStack,
    keys: torch.Tensor,
    values: torch.Tensor,
    span: int,
    members: slice = slice(None),
) -> Callable[..., torch.Tensor]:
    """(hidden [B, D], inputs [2, B]: slots, positions) -> the logits [count, B, V] of the
    heads `members` (default: all), over `keys` and `values` (a pool's, or a view of those
    members in it), attending `span` positions."""

    def run(hidden: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        slots, positions = inputs
        batch = SlotBatch(keys, values, slots, positions, span)
        return heads.forward_static(hidden, batch, members)

    return run


class DecodeGraph:
    """Trunk and a head stack over one session's next token, one position at a time, as
    one step (the bare loop of `bench-gpu`; the workers keep the trunk's and the heads'
    steps apart), recorded once per attended span, bound to these caches."""

    def __init__(
        self,
        trunk: Trunk,
        heads: HeadStack,
        trunk_cache: KVCache,
        head_cache: KVCache,
        *,
        graph: bool | None = None,
    ) -> None:
        device = trunk.rope.cos.device
        if graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this model is on {device}")
        self.trunk, self.heads = trunk, heads
        self.caches = (trunk_cache, head_cache)
        self.use_graph = device.type == "cuda" if graph is None else graph
        self._steps = StepGraphs("graph" if self.use_graph else "eager", device)

    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """`token` [1] (on the model's device) at position `start` -> logits [S, 1, V]
        float32, appending the position to both caches. With a graph the logits are the
        graph's own output buffer, overwritten by the next step: use or copy them first."""
        for cache in self.caches:
            cache.check_append(start, 1)
        capacity = min(cache.capacity for cache in self.caches)
        logits = self._steps.run(("decode",), self._at, [(0, start)], capacity, token.reshape(1))
        for cache in self.caches:
            cache.advance(1)
        return logits

    def _at(self, span: int) -> Callable[..., torch.Tensor]:
        """The step attending `span` positions: (tokens [1], inputs [2, 1]: slots,
        positions) -> logits, each cache seen as a pool of one slot (slot 0)."""
        (trunk_cache, head_cache), trunk, heads = self.caches, self.trunk, self.heads

        def run(tokens: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
            slots, positions = inputs
            through_trunk = (trunk_cache.keys[None], trunk_cache.values[None], slots, positions)
            hidden = trunk.forward_static(tokens, SlotBatch(*through_trunk, span))
            through_heads = (head_cache.keys[None], head_cache.values[None], slots, positions)
            return heads.forward_static(hidden, SlotBatch(*through_heads, span))

        return run
