"""The tensor-parallel group one process's model belongs to: its rank, the group's size, and the
two collectives a split model needs (sum partial results over the ranks; send rank 0's tensor
to every rank).

:data:`SINGLE` is the group of one: it communicates nothing (``all_reduce`` returns its argument
untouched), so a model built without tensor parallelism runs exactly as it did before the split
existed. :class:`DistGroup` is the group over ``torch.distributed``: gloo on the CPU, NCCL on
CUDA, HCCL on an NPU, rendezvous through a ``TCPStore`` that rank 0 serves on ``127.0.0.1`` (the
ranks of one engine share a machine). It uses the process's default group, so a process belongs
to one group at a time.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import TensorParallelError

# a collective waits this long for a slower rank; ranks idle on a pipe, never in a collective
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class TPGroup:
    """A rank among ``size`` tensor-parallel ranks; this base class is the group of one."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (in place; returns ``x``)."""
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place; returns ``x``)."""
        return x

    def close(self) -> None:
        """Leave the group."""


SINGLE = TPGroup()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where rank ``rank`` of an engine on ``device`` computes: the CPU for every rank of a CPU
    engine, else the ``rank``-th accelerator after ``device``'s index."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def serve_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of ``127.0.0.1`` (read it from ``.port``)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=COLLECTIVE_TIMEOUT)


def join_store(port: int, size: int) -> dist.TCPStore:
    """A client of rank 0's :func:`serve_store` on ``port``."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


class DistGroup(TPGroup):
    """Rank ``rank`` of ``size`` over ``torch.distributed``. A model may be built with the group
    before it is joined; collectives run once :meth:`join` returned."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.joined = False

    def join(self, store: dist.Store, device: torch.device) -> None:
        """Join through ``store`` (rank 0's :func:`serve_store`, or a client of it on the other
        ranks), computing on ``device``; waits for every rank."""
        if dist.is_initialized():
            raise TensorParallelError("this process already belongs to a tensor-parallel group: "
                                      "close the other tensor-parallel engine first")
        dist.init_process_group(BACKENDS[device.type], store=store, rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        self.joined = True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, 0)
        return x

    def close(self) -> None:
        if self.joined:
            self.joined = False
            dist.destroy_process_group()
