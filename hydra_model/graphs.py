"""A session's decode step replayed from a CUDA graph.

On a GPU, a decode step of a small model is bound by the host, not the device: each of
its few hundred kernels takes microseconds to run and longer to launch from Python. A
CUDA graph records the step's kernels once and replays them with one launch. Recording
needs a step whose shapes and memory never change and which reads nothing back to the
host: `forward_static` of the trunk and heads (attention over the cache's whole
capacity, masked past the position a device tensor holds, keys and values written by
index). Its inputs live in buffers the graph reads; its logits in a buffer it writes.

Eager fallback: on a CPU, or with `graph=False`, the same fixed-shape step runs eagerly,
so the graph and eager paths compute the same operations in the same order.
"""

from __future__ import annotations

import torch

from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.kv_cache import KVCache
from hydra_jury.hydra_model.trunk import Trunk

WARMUP_STEPS = 2  # eager runs on a side stream before recording: cuBLAS sets itself up


class DecodeGraph:
    """Trunk and a head stack over one session's next token, one position at a time.

    The graph is recorded on the first step and bound to these caches: a session keeps
    its `DecodeGraph` for as long as it keeps its caches."""

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
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """`token` [1] (on the model's device) at position `start` -> logits [S, 1, V]
        float32, appending the position to both caches. With a graph the logits are the
        graph's own output buffer, overwritten by the next step: use or copy them first."""
        for cache in self.caches:
            cache.check_append(start, 1)
        self._token.copy_(token.reshape(1))
        self._position.fill_(start)
        if not self.use_graph:
            logits = self._run()
        else:
            if self._graph is None:
                self._record()
            self._graph.replay()
            logits = self._logits
        for cache in self.caches:
            cache.advance(1)
        return logits

    def _run(self) -> torch.Tensor:
        trunk_cache, head_cache = self.caches
        hidden = self.trunk.forward_static(self._token, trunk_cache, self._position)
        return self.heads.forward_static(hidden, head_cache, self._position)

    def _record(self) -> None:
        # The warm-up steps write this step's own keys and values at this step's own
        # position: the replay that follows writes the same ones again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self._run()
        self._graph = graph
