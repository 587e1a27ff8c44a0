"""The process of a tensor-parallel rank other than 0: it holds its share of the model and its
share of every KV page (its key/value heads), and runs every forward rank 0 runs, on the inputs
rank 0 broadcasts (:mod:`engine.tp_messages`). It schedules and samples nothing.

With ``config.layers`` (a pipeline stage's share) the rank holds those decoder layers only, its
pool holds them, and the broadcast tensor is the hidden state entering the first of them: each
forward runs :meth:`Qwen2VLModel.forward_layers` over that range, as rank 0's stage does.

Life: load the model's share and build the pool, report ready (or the load's error) on the
pipe, join the group, then serve headers until STOP, or until rank 0's end of the pipe closes.
Any error is reported on the pipe, printed with its traceback, and ends the process (exit 1).
A clean end skips the interpreter's teardown (``os._exit``): the process holds nothing to save.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.attention import AttentionBackend
from engine.attention_select import make_attention
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_device, resolve_dtype
from engine.kv_cache import KVPool
from engine.models.qwen2_vl import Qwen2VLModel
from engine.parallel import DistGroup, join_store, rank_device
from engine.tp_messages import Command, RankReport, StepHeader, unpack_step
from engine.tp_shard import TextShard

RankAttach = Callable[[KVPool, int], bytes]
"""A node's hook run in a rank's process once its pool is built, given the pool and the rank:
what it returns reaches rank 0 with the ready report (:attr:`engine.tp_driver.TPDriver.payloads`)
and what it builds (a transfer engine with the pool registered) lives as long as the process.
It crosses into a spawned process by reference, so it must be a module-level function or an
instance of a module-level class."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank's process is started with; ``config`` is rank 0's, with its device and dtype
    resolved and its page count fixed; ``attach``: the node's hook (:data:`RankAttach`)."""

    model_dir: str
    config: EngineConfig
    rank: int
    store_port: int
    num_threads: int  # torch threads of this process
    attach: RankAttach | None = None

    @property
    def num_pages(self) -> int:
        assert self.config.num_pages is not None, "rank 0 fixes the page count"
        return self.config.num_pages


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of a rank's process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when this process ends
    torch.set_num_threads(spec.num_threads)
    group = DistGroup(spec.rank, spec.config.tp_size)
    try:
        device = rank_device(resolve_device(spec.config.device), spec.rank)
        model, pool = _build(spec, group, device)
        payload = spec.attach(pool, spec.rank) if spec.attach is not None else b""
        conn.send_bytes(RankReport(spec.rank, payload=payload).encode())
        group.join(join_store(spec.store_port, group.size), device)
        _serve(conn, model, _layers(spec), make_attention(pool), device)
    except EOFError:  # rank 0 is gone
        pass
    except BaseException as exc:
        traceback.print_exc()
        with suppress(OSError):
            conn.send_bytes(RankReport(spec.rank, f"{type(exc).__name__}: {exc}").encode())
        sys.exit(1)
    group.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _build(spec: RankSpec, group: DistGroup, device: torch.device
           ) -> tuple[Qwen2VLModel, KVPool]:
    """This rank's model share (of ``config.layers`` when set), and its KV pool (rank 0's page
    count, this rank's key/value heads, those layers)."""
    config = spec.config
    if device.type != "cpu":  # NCCL and HCCL take the rank's device from the current one
        getattr(torch, device.type).set_device(device)
    dtype = resolve_dtype(config.dtype, device)
    model_config, model = load_model(spec.model_dir, dtype, device, config.layers, tp=group)
    text = model_config.text
    shard = TextShard.of(text, group.rank, group.size)
    pool = KVPool(spec.num_pages + 1, config.page_size, shard.num_kv_heads, text.head_dim,
                  list(_layers(spec)), dtype, device)
    return model, pool


def _layers(spec: RankSpec) -> range:
    """The global decoder layers this rank holds (every one without ``config.layers``)."""
    if spec.config.layers is not None:
        return spec.config.layers
    return range(ModelConfig.from_dir(spec.model_dir).text.num_hidden_layers)


@torch.inference_mode()
def _serve(conn: Connection, model: Qwen2VLModel, layers: range, attn: AttentionBackend,
           device: torch.device) -> None:
    """Run the forwards rank 0 announces over ``layers`` until it says STOP."""
    tp = model.tp
    while True:
        header = StepHeader.decode(conn.recv_bytes())
        if header.command == Command.STOP:
            return
        packed = torch.empty(header.packed_len(), dtype=torch.int64, device=device)
        embeds = torch.empty(header.num_tokens, header.hidden, dtype=model.dtype, device=device)
        mrope, batch = unpack_step(header, tp.broadcast(packed))
        tp.broadcast(embeds)
        attn.prepare(batch)
        # rank 0's own layers' output (before its final norm, a per-rank op); rank 0 samples
        model.forward_layers(embeds, mrope, attn, layers, final_norm=False)
