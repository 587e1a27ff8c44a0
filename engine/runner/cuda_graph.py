"""Forwards over static buffers, one per padded batch size: CUDA graphs on CUDA, eager elsewhere.

A *static forward* is a callable that reads only persistent buffers and returns a tensor. On a
CUDA device with graphs on, :class:`GraphCache` captures it once per padded size (after a
warm-up run on a side stream, so lazy allocations and Triton compilation happen outside the
capture) into one shared memory pool, and later calls replay the graph: the host launches one
graph instead of every kernel of every layer. In a shared pool a graph's output may lie in
memory another graph uses for its temporaries, so a replay of *any* graph can overwrite it:
:meth:`GraphCache.run` therefore hands out a copy of the output (one device copy of the
output's size per replay; the pool stays shared, which is what keeps the captured graphs'
memory to that of the largest one rather than their sum). Elsewhere (CPU, NPU,
``--no-graphs``) the callable simply runs, which is what lets the padding and buffer logic be
tested on a CPU.

Invariants a static forward keeps, so that a replay equals an eager run over fresh buffers:
every input is copied into the buffers *before* the call, host-side values baked into the
callable are capacities (never a batch's own maxima) when :attr:`GraphCache.captures`, and a
graph is keyed by everything that changes what it computes (its name says the kind of forward,
e.g. a tree verify apart from a chain one, and the padded size the rest). The tensor
:meth:`GraphCache.run` returns is the caller's: no later call changes it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

StaticForward = Callable[[], torch.Tensor]

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes_for(max_bs: int, sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES) -> list[int]:
    """The sizes below ``max_bs`` and ``max_bs`` itself, ascending (every batch fits one)."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be >= 1, got {max_bs}")
    return sorted({*(s for s in sizes if 0 < s < max_bs), max_bs})


class GraphCache:
    """Static forwards keyed by ``(name, padded size)``, captured on first use when
    :attr:`captures`."""

    def __init__(self, device: torch.device, sizes: Sequence[int], enabled: bool) -> None:
        if not sizes:
            raise ValueError("at least one capture size is needed")
        self.sizes = sorted(set(sizes))
        self.captures = enabled and device.type == "cuda"
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.captures else None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def padded(self, n: int) -> int:
        """The smallest size ``>= n``; ``ValueError`` when ``n`` is out of range."""
        k = bisect.bisect_left(self.sizes, n)
        if n < 1 or k == len(self.sizes):
            raise ValueError(f"batch of {n} does not fit the sizes {self.sizes}")
        return self.sizes[k]

    def run(self, name: str, size: int, fn: StaticForward) -> torch.Tensor:
        """``fn()``, through its captured graph for ``(name, size)`` when capturing; the
        result is a copy of the graph's output (valid after later replays of any graph)."""
        if not self.captures:
            return fn()
        entry = self._graphs.get((name, size))
        if entry is None:
            entry = self._capture(fn)
            self._graphs[(name, size)] = entry
        else:
            entry[0].replay()
        return entry[1].clone()

    def _capture(self, fn: StaticForward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: allocator, cuBLAS workspaces, Triton compilation
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        graph.replay()  # the capture only recorded: run it once for this call's result
        return graph, out
