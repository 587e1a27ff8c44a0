"""Test helpers: KV pools filled with known bytes and a second process holding one node side.

A peer process is started with ``spawn`` and runs one object (a decode KV manager, a prefill
bootstrap server or a decode bootstrap client); the test calls its methods over a pipe. Every
engine and server binds 127.0.0.1.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv.pool import KVPool
from engine.kv.staging import HeadLandingBuffer, HeadStagingBuffer
from engine.kv.state_pool import StatePool
from serving.process_exit import exit_process, keep_until_exit
from transfer.aux import AuxBuffer
from transfer.backends.ascend import AscendKVManager
from transfer.backends.mooncake import MooncakeKVManager, create_mooncake_engine
from transfer.base import KVManager
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.plan.heads import HeadLayout
from transfer.plan.states import StateLayout

HOST = "127.0.0.1"
HIDDEN = 8


@dataclass(frozen=True)
class StateSpec:
    """A node's linear-attention state entries: the layers they belong to, the whole layer's
    geometry (float32 conv states) and this node's share of it (rank ``rank`` of ``tp``)."""

    layer_ids: tuple[int, ...]
    num_slots: int = 8
    num_k_heads: int = 2
    head_k_dim: int = 4
    num_v_heads: int = 4
    head_v_dim: int = 3
    conv_kernel: int = 4
    tp: int = 1
    rank: int = 0

    @property
    def layout(self) -> StateLayout:
        return StateLayout(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim,
                           self.conv_kernel, 4, self.tp)

    def pool(self) -> StatePool:
        """This rank's pool: its share of the key and value heads."""
        k, v = self.num_k_heads // self.tp, self.num_v_heads // self.tp
        channels = 2 * k * self.head_k_dim + v * self.head_v_dim
        return StatePool(self.num_slots, list(self.layer_ids), channels, self.conv_kernel, v,
                         self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class Spec:
    """Shape of one node's KV: target layer ids, optional draft band ids, pool geometry."""

    layer_ids: tuple[int, ...] = (0, 1, 2, 3)
    draft_ids: tuple[int, ...] = ()
    num_pages: int = 64
    page_size: int = 4
    heads: int = 2
    head_dim: int = 8
    aux_rows: int = 4
    backend: str = "mooncake"  # or "ascend" (Ascend manager over an injected TCP engine)
    fingerprint: str = "model-a"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> ModelIdentity:
        """The node's identity; ``extra["tp"] = (kv heads, tp size, rank)`` adds its heads."""
        states = self.extra["states"].layout if "states" in self.extra else None
        if "tp" not in self.extra:
            return ModelIdentity(self.fingerprint, self.page_size, "torch.float32",
                                 states=states)
        kv, size, rank = self.extra["tp"]
        heads = HeadLayout.tensor_parallel(kv, size, head_dim=self.head_dim,
                                           dtype="torch.float32", page_size=self.page_size)
        return ModelIdentity(self.fingerprint, self.page_size, "torch.float32", heads=heads,
                             tp_rank=rank, states=states)


class Node:
    """One node's pools, aux buffer and registered manager."""

    def __init__(self, spec: Spec, fill_seed: int | None = None,
                 silent_peer_s: float | None = None) -> None:
        self.spec = spec
        geo = (spec.num_pages, spec.page_size, spec.heads, spec.head_dim)
        self.pools = [KVPool(*geo, layer_ids=list(spec.layer_ids))]
        if spec.draft_ids:
            self.pools.append(KVPool(*geo, layer_ids=list(spec.draft_ids)))
        state_spec: StateSpec | None = spec.extra.get("states")
        self.states = state_spec.pool() if state_spec is not None else None
        if fill_seed is not None:
            gen = torch.Generator().manual_seed(fill_seed)
            for buf in [*self.entries(), *self.state_entries()]:
                buf.copy_(torch.randn(buf.shape, generator=gen))
        self.aux = AuxBuffer(spec.aux_rows, HIDDEN)
        self.manager = make_manager(spec, silent_peer_s)
        infos = [info for pool in self.pools for info in pool.buffer_infos()]
        staging_bytes = spec.extra.get("staging_bytes", 0)
        self.staging = HeadStagingBuffer(self.entries(), staging_bytes) if staging_bytes else None
        slices = spec.extra.get("landing", ())  # (head_start, count) of each incoming slice
        self.landing = (HeadLandingBuffer(self.entries(), self.layer_ids(), slices,
                                          spec.num_pages) if slices else None)
        self.manager.register(infos, self.aux, use_layer_ids=spec.extra.get("ids", True),
                              staging=self.staging,
                              landing=self.landing.buffer_infos() if self.landing else (),
                              states=self.states.buffer_infos() if self.states else ())
        # kept (buffers and engine) until the process ends, which skips the engine's one-second
        # destructor: a peer process exits when stopped, the test process after the session
        keep_until_exit(self)

    def entries(self) -> list[torch.Tensor]:
        return [e for pool in self.pools for e in pool.entries()]

    def layer_ids(self) -> list[int]:
        return [i for pool in self.pools for i in pool.entry_layer_ids()]

    def state_entries(self) -> list[torch.Tensor]:
        """The state pool's tensors in transfer order (conv of every layer, then recurrent)."""
        if self.states is None:
            return []
        n = self.states.num_layers
        return [*(self.states.conv(i) for i in range(n)),
                *(self.states.recurrent(i) for i in range(n))]

    def dump(self) -> list[bytes]:
        return [e.numpy().tobytes() for e in self.entries()]

    def dump_states(self) -> list[bytes]:
        return [e.numpy().tobytes() for e in self.state_entries()]

    def zero(self) -> None:
        landed = [b for slot in self.landing.land for b in slot] if self.landing else []
        for e in [*self.entries(), *landed, *self.state_entries()]:
            e.zero_()

    def registration(self) -> Any:
        ident = self.spec.identity
        return self.manager.registration(
            page_size=ident.page_size, dtype=ident.dtype, model_fingerprint=ident.model_fingerprint,
            heads=ident.heads, tp_rank=ident.tp_rank, states=ident.states,
        )


class Ranks:
    """A decode of several TP ranks in one process: one :class:`Node` per rank spec."""

    def __init__(self, specs: list[Spec]) -> None:
        self.nodes = [Node(spec) for spec in specs]

    def registration(self) -> list[Any]:
        return [node.registration() for node in self.nodes]

    def dump(self, rank: int) -> list[bytes]:
        return self.nodes[rank].dump()

    def dump_states(self, rank: int) -> list[bytes]:
        return self.nodes[rank].dump_states()

    def landing(self, rank: int, slot: int) -> tuple[list[int], list[int], list[int]]:
        """(pointers, layer ids, bytes per page) of rank ``rank``'s landing entries of ``slot``."""
        landing = self.nodes[rank].landing
        assert landing is not None
        infos = landing.buffer_infos(slot)
        return ([b.ptr for b in infos], [b.layer_id for b in infos],
                [b.bytes_per_page for b in infos])

    def scatter(self, rank: int, landing_pages: list[int], pages: list[int]) -> None:
        landing = self.nodes[rank].landing
        assert landing is not None
        landing.scatter(landing_pages, pages)

    def zero(self) -> None:
        for node in self.nodes:
            node.zero()


def make_manager(spec: Spec, silent_peer_s: float | None = None) -> KVManager:
    """The node's manager; ``silent_peer_s``: its transfer keepalive, as a decode's."""
    if spec.backend == "ascend":
        engine = create_mooncake_engine(HOST)
        return AscendKVManager(hostname=HOST, protocol="tcp", engine=engine,
                               batch_limit=spec.extra.get("batch_limit", 1024))
    return MooncakeKVManager(hostname=HOST, batch_limit=spec.extra.get("batch_limit", 1024),
                             silent_peer_s=silent_peer_s)


class FreeList:
    """A page allocator stand-in: hands out page ids, takes them back, counts what is held."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages))
        self.total = num_pages

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, pages: list[int]) -> None:
        assert not set(pages) & set(self.free), "page freed twice"
        self.free.extend(pages)

    @property
    def held(self) -> int:
        return self.total - len(self.free)


def _build(role: str, spec: Spec, arg: Any) -> Any:
    from transfer.bootstrap.decode import DecodeBootstrapClient
    from transfer.bootstrap.prefill import PrefillBootstrapServer

    cfg: BootstrapConfig = spec.extra.get("config", BootstrapConfig())
    if role == "node":
        return Node(spec)
    if role == "ranks":
        return Ranks(arg)
    if role == "prefill":
        node = Node(spec, fill_seed=1)
        server = PrefillBootstrapServer(node.manager, spec.identity, host=HOST, config=cfg)
        server.node = node  # type: ignore[attr-defined]  # keep the buffers alive
        return server
    node = Node(spec, silent_peer_s=cfg.peer_timeout_s)  # as decode_node.server builds it
    pages = FreeList(spec.num_pages)
    client = DecodeBootstrapClient(node.manager, spec.identity, arg, pages.give, config=cfg)
    client.node, client.pages = node, pages  # type: ignore[attr-defined]
    return client


def _child(conn: Any, role: str, spec: Spec, arg: Any) -> None:
    serve(conn, role, spec, arg)


def serve(conn: Any, role: str, spec: Spec, arg: Any) -> None:
    """A peer process's life: build ``role``, send what it publishes (a node's registration,
    an endpoint's address), then answer ``(name, args, kwargs)`` calls (``name`` a dotted
    attribute path of the role's object; one not callable is returned as it is) until
    ``stop``."""
    obj = _build(role, spec, arg)
    ready = obj.registration() if role in ("node", "ranks") else getattr(obj, "address", None)
    conn.send(ready)
    while True:
        name, args, kwargs = conn.recv()
        if name == "stop":  # leave without the engines' one-second destructors
            exit_process(0)
            return
        try:
            target = obj
            for part in name.split("."):
                target = getattr(target, part)
            conn.send(("ok", target(*args, **kwargs) if callable(target) else target))
        except Exception as exc:  # report to the test, keep serving
            conn.send(("err", repr(exc)))


class Peer:
    """Parent-side handle of a peer process."""

    def __init__(self, role: str, spec: Spec, arg: Any = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, role, spec, arg), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise TimeoutError(f"{role} peer did not start")
        self.ready = self.conn.recv()

    def call(self, name: str, *args: Any) -> Any:
        self.conn.send((name, args, {}))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {name} failed: {value}")
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", (), {}))
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
