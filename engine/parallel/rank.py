"""The process of a tensor-parallel rank other than 0: it holds its share of the model and its
share of every KV page (its key/value heads) and, for a hybrid model, of every state slot (its
linear-attention heads), and runs every forward rank 0 runs, on the inputs rank 0 broadcasts
(:mod:`engine.parallel.messages`): a Qwen3-VL forward's DeepStack features, a hybrid forward's
:class:`StateStep` (slots zeroed and prepared as rank 0 did its own). It schedules and samples
nothing.

With ``config.layers`` (a pipeline stage's share) the rank holds those decoder layers only, its
pool holds them, and the broadcast tensor is the hidden state entering the first of them: each
forward runs :meth:`Qwen2VLModel.forward_layers` over that range, as rank 0's stage does.

With an EAGLE draft (``RankSpec.draft``) the rank also holds its share of the draft's layer and
a draft pool of its key/value heads (the draft band, pages mirroring its target pool's) and runs
the draft's layer on :attr:`Command.DRAFT`; :attr:`Command.MOVE_KV` copies target K/V between
slots (a draft tree's accepted path); :attr:`Command.KEEP_STATES` ends a hybrid model's verify
(each slot keeps the state after its accepted rows).

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
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.linear.states import LinearStates
from engine.attention.select import make_attention
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.device import keep_freed_memory, resolve_device, resolve_dtype
from engine.kv.pool import KVPool, move_kv
from engine.kv.state_pool import StatePool
from engine.models.eagle.eagle3 import Draft
from engine.models.eagle.loader import load_draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.step_extras import StepExtras
from engine.parallel.group import DistGroup, TPGroup, join_store, rank_device
from engine.parallel.messages import (
    Command,
    RankReport,
    StateStep,
    StepHeader,
    read_step_message,
    unpack_step,
)
from engine.parallel.shard import TextShard

RankAttach = Callable[[Sequence[KVPool], int, StatePool | None], bytes]
"""A node's hook run in a rank's process once its pools are built, given them (the target's,
then a draft's when the rank holds one), the rank and its state pool (a hybrid model's; None
without one):
what it returns reaches rank 0 with the ready report
(:attr:`engine.parallel.driver.TPDriver.payloads`) and what it builds (a transfer engine with the
pool registered) lives as long as the process. It crosses into a spawned process by reference, so it
must be a module-level function or an instance of a module-level class."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank's process is started with; ``config`` is rank 0's, with its device and dtype
    resolved and its page count fixed; ``attach``: the node's hook (:data:`RankAttach`);
    ``draft``: an EAGLE draft directory whose layer the ranks share too."""

    model_dir: str
    config: EngineConfig
    rank: int
    store_port: int
    num_threads: int  # torch threads of this process
    attach: RankAttach | None = None
    draft: str | None = None

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
        if device.type == "cpu":
            keep_freed_memory()
        else:  # NCCL and HCCL take the rank's device from the current one
            getattr(torch, device.type).set_device(device)
        model, pool, states = _build(spec, group, device)
        draft = _build_draft(spec, model, pool, group, device)
        pools = [pool] if draft is None else [pool, draft.pool]
        state_pool = states.pool if states is not None else None
        payload = spec.attach(pools, spec.rank, state_pool) if spec.attach is not None else b""
        conn.send_bytes(RankReport(spec.rank, payload=payload).encode())
        group.join(join_store(spec.store_port, group.size), device)
        _serve(conn, RankShares(model, _layers(spec), make_attention(pool), draft, states), device)
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
           ) -> tuple[Qwen2VLModel, KVPool, LinearStates | None]:
    """This rank's model share (of ``config.layers`` when set), its KV pool (rank 0's page
    count, this rank's key/value heads, the full-attention layers among those) and a hybrid
    model's state pool (rank 0's slot count, its state checkpoints included, this rank's
    linear-attention heads, the linear layers among those; None without any: as the engine's
    ``hybrid_states`` for rank 0), on ``device`` (made current by :func:`rank_main`)."""
    config = spec.config
    dtype = resolve_dtype(config.dtype, device)
    model_config, model = load_model(spec.model_dir, dtype, device, config.layers, tp=group)
    text, layers = model_config.text, _layers(spec)
    shard = TextShard.of(text, group.rank, group.size)
    pool = KVPool(spec.num_pages + 1, config.page_size, shard.num_kv_heads, text.head_dim,
                  text.attention_layers(layers), dtype, device)
    lin, linear_ids = shard.linear_here, text.linear_layers(layers)
    if lin is None or not linear_ids:
        return model, pool, None
    states = StatePool(config.state_pool_slots, linear_ids, lin.conv_channels, lin.conv_kernel,
                       lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, dtype, device)
    return model, pool, LinearStates(states, verify_states=config.verify_states)


@dataclass
class DraftShare:
    """This rank's share of the draft's layer, its draft pool and that pool's attention."""

    draft: Draft
    pool: KVPool
    attn: AttentionBackend


def _build_draft(spec: RankSpec, model: Qwen2VLModel, pool: KVPool, group: DistGroup,
                 device: torch.device) -> DraftShare | None:
    """This rank's share of the draft's layer and its draft pool (None without a draft)."""
    if spec.draft is None:
        return None
    draft = load_draft(spec.draft, model.cfg.text, model.dtype, device, tp=group)
    dpool = KVPool(pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim,
                   [draft.cfg.layer_id], pool.dtype, device)
    return DraftShare(draft, dpool, make_attention(dpool))


@dataclass
class RankShares:
    """What a rank runs: its target layers and pool, its draft share and its state pool."""

    model: Qwen2VLModel
    layers: range
    attn: AttentionBackend
    draft: DraftShare | None
    states: LinearStates | None


def _layers(spec: RankSpec) -> range:
    """The global decoder layers this rank holds (every one without ``config.layers``)."""
    if spec.config.layers is not None:
        return spec.config.layers
    return range(ModelConfig.from_dir(spec.model_dir).text.num_hidden_layers)


@torch.inference_mode()
def _serve(conn: Connection, shares: RankShares, device: torch.device) -> None:
    """Run the forwards and moves rank 0 announces until it says STOP."""
    tp = shares.model.tp
    while True:
        header, states = read_step_message(conn.recv_bytes())
        if header.command == Command.STOP:
            return
        run_command(shares, header, states, tp, device)


@torch.inference_mode()
def run_command(shares: RankShares, header: StepHeader, states: StateStep | None, tp: TPGroup,
                device: torch.device) -> None:
    """Run one command rank 0 announced (any but STOP) with ``header`` and, for a hybrid
    model's forward, its ``states``: receive the step's tensors over ``tp`` (made here on
    ``device``), then run the forward, the draft's layer, the KV move or the kept states."""
    model = shares.model
    packed = tp.broadcast(torch.empty(header.packed_len(), dtype=torch.int64, device=device))
    if header.command == Command.MOVE_KV:
        src, dst = packed.split(header.num_tokens)
        move_kv(shares.attn.pool, src, dst)
        return
    if header.command == Command.KEEP_STATES:
        if shares.states is None:
            raise RuntimeError("rank 0 kept verified states, but this rank holds no state pool")
        shares.states.keep(packed)
        return
    rows = torch.empty(header.num_tokens, header.hidden, dtype=model.dtype, device=device)
    mrope, batch = unpack_step(header, packed)
    tp.broadcast(rows)
    if header.command == Command.DRAFT:
        if shares.draft is None:
            raise RuntimeError("rank 0 ran a draft forward, but this rank holds no draft")
        shares.draft.attn.prepare(batch)
        shares.draft.draft.run_layer(rows, mrope, shares.draft.attn)
        return
    extras = _step_extras(header, states, shares, tp, device)
    shares.attn.prepare(batch)
    # rank 0's own layers' output (before its final norm, a per-rank op); rank 0 samples
    model.forward_layers_aux(rows, mrope, shares.attn, shares.layers, final_norm=False,
                             extras=extras)
    if states is not None and extras.states is not None:
        states.saved(extras.states)


def _step_extras(header: StepHeader, states: StateStep | None, shares: RankShares, tp: TPGroup,
                 device: torch.device) -> StepExtras:
    """A target forward's extras: the DeepStack rows and features rank 0 broadcasts after the
    input rows, and this rank's state pool with ``states`` applied (as rank 0 applied it to
    its own)."""
    stack_rows: torch.Tensor | None = None
    stack: tuple[torch.Tensor, ...] = ()
    if header.stack_layers:
        v, dtype = header.stack_rows, shares.model.dtype
        stack_rows = tp.broadcast(torch.empty(v, dtype=torch.int64, device=device))
        features = torch.empty(header.stack_layers, v, header.hidden, dtype=dtype, device=device)
        stack = tuple(tp.broadcast(features).unbind(0))
    prepared: LinearStates | None = None
    if states is not None:
        if shares.states is None:
            raise RuntimeError("rank 0 ran a hybrid forward, but this rank holds no state pool")
        prepared = states.apply(shares.states)
    return StepExtras(stack_rows, stack, prepared)
