"""A decode worker's start-up warm-up: every Triton specialisation its eager forwards launch,
compiled (:func:`kernels`), and every CUDA graph its serving can replay, captured
(:func:`warm_up`), before any other thread runs.

Graphs captured lazily while serving would be captured while a Mooncake or gRPC thread may touch
CUDA (which breaks a capture in global mode), and the first request at each new batch size
would pay the capture and the kernels' compilation. So the worker captures them all first, right
after loading the model and before its transfer engine, its step loop and its server start: the
decode step's graph at every padded size (:meth:`DecodeGraphs.capture_all`) or, with EAGLE, the
verify and draft-extend graphs instead (:meth:`SpecGraphRunner.capture_all`; the plain decode
graphs go unused there). Each capture runs its forward once first, which also compiles the
Triton kernels for that shape. :class:`WarmUp` says what was captured, in how long and with how
much device memory, or why nothing was (graphs are CUDA's, and off with ``--no-graphs``, the
torch attention backend, tensor parallelism or a hybrid model). The kernels of the forwards
that are not captured (prefill chunks, mixed batches, the decode steps of an engine without
graphs, a draft tree's masked forwards) are compiled first by
:func:`engine.runner.kernel_warmup.warm_kernels`, given the tree's forwards
(:func:`tree_forwards`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.attention.select import backend_name, triton_problem
from engine.llm_engine import LLMEngine
from engine.runner.kernel_warmup import KernelWarmUp, warm_kernels

MIB = 1 << 20


@dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_up` captured (``name:size`` each), the seconds and the device memory
    it took, or (nothing captured) why not."""

    graphs: list[str]
    seconds: float = 0.0
    memory_bytes: int = 0
    reason: str = ""

    def line(self) -> str:
        """The start-up line a worker prints."""
        if not self.graphs:
            return f"graphs: none captured ({self.reason})"
        kinds: dict[str, list[str]] = {}
        for graph in self.graphs:
            name, size = graph.split(":")
            kinds.setdefault(name, []).append(size)
        listed = "; ".join(f"{name} at {' '.join(sizes)}" for name, sizes in kinds.items())
        return (f"graphs: captured {len(self.graphs)} ({listed}) in {self.seconds:.1f} s, "
                f"{self.memory_bytes / MIB:.0f} MiB")


def tree_forwards(shape: TreeShape) -> list[tuple[int, int]]:
    """The masked forwards of ``shape``'s rounds as ``(rows, window)``: each depth's draft
    forward (``topk`` rows over the ``i * topk`` keys drafted so far) and the verify (``N``
    rows over ``N``); none for a chain."""
    if shape.is_chain:
        return []
    k, n = shape.topk, shape.num_draft_tokens + 1
    return [(k, i * k) for i in range(1, shape.depth)] + [(n, n)]


def kernels(engine: LLMEngine, spec: EagleEngine | None) -> KernelWarmUp:
    """Compile the kernels of ``engine``'s eager forwards (through ``spec``'s tree when given)."""
    return warm_kernels(engine, tree_forwards(spec.shape) if spec is not None else ())


def warm_up(engine: LLMEngine, spec: EagleEngine | None) -> WarmUp:
    """Capture every graph ``engine`` (decoding through ``spec`` when given) can replay."""
    reason = _no_graphs(engine)
    if reason:
        return WarmUp([], reason=reason)
    torch.cuda.synchronize()
    before, start = torch.cuda.memory_reserved(), time.perf_counter()
    if spec is not None:
        graphs = spec.graph.capture_all(tree=not spec.shape.is_chain)
    else:
        assert engine.runner.decode_graphs is not None
        graphs = engine.runner.decode_graphs.capture_all()
    torch.cuda.synchronize()
    return WarmUp(graphs, time.perf_counter() - start, torch.cuda.memory_reserved() - before)


def _no_graphs(engine: LLMEngine) -> str:
    """Why ``engine`` runs no graph (empty when it does)."""
    config = engine.config
    if engine.device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this worker runs on {engine.device.type}"
    if not config.graphs:
        return "--no-graphs"
    if backend_name(engine.pool) != "triton":
        return f"the torch attention backend runs eagerly: {triton_problem()}"
    if engine.tp is not None:
        return "tensor-parallel steps run eagerly"
    if engine.states is not None:
        return "a hybrid model's steps run eagerly"
    return ""
