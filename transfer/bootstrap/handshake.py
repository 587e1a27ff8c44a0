"""The P/D handshake: shared configuration and the compatibility check at registration.

Protocol (one TCP connection per decode node and prefill node, frames of
:mod:`transfer.bootstrap.wire`):

1. The decode connects to the prefill's bootstrap endpoint and sends its
   :class:`~transfer.bootstrap.messages.Registration` once; the prefill answers
   :class:`~transfer.bootstrap.messages.RegisterReply` (a mismatched pair, or a registration
   without the shared secret when the prefill has one, is refused with the reason).
2. Per room the decode sends a :class:`~transfer.bootstrap.messages.Destination` (its page ids
   and aux slot). The prefill gates compute on the room until it has arrived.
3. The prefill pushes each chunk's pages through its KV manager, writes the aux row on the last
   chunk and only then sends ``Status(Success)``.
4. Failure: either side may send :class:`~transfer.bootstrap.messages.Abort`. The prefill sends
   its final word on a room (``Status``, ``Abort`` or ``AbortAck``) only once no write into the room
   is in flight, and marks it ``quiesced`` when no write can still land. The decode frees a failed
   room's pages only after such a quiesced word, or after ``quarantine_s``.
5. The decode sends a :class:`~transfer.bootstrap.messages.Heartbeat` every
   ``heartbeat_interval_s``; a peer silent for ``heartbeat_interval_s * heartbeat_misses`` (or a
   closed connection) fails every room it shared, on both sides.

Implementations: :mod:`transfer.bootstrap.prefill` and :mod:`transfer.bootstrap.decode`.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transfer.aux import AuxBuffer
from transfer.base import SendResult
from transfer.bootstrap.messages import Registration
from transfer.errors import (
    HeadLayoutError,
    IncompatiblePeerError,
    LayerPairingError,
    PeerAuthError,
)
from transfer.faults import FaultConfig
from transfer.plan.head_blocks import head_geometry
from transfer.plan.heads import HeadCopy, HeadLayout, plan_head_copies, receivers
from transfer.plan.layers import check_bytes_per_page, pair_entries
from transfer.plan.states import StateCopy, StateLayout, entry_kinds, plan_state_copy


@dataclass(frozen=True)
class BootstrapConfig:
    """Timeouts of the handshake, in seconds, and the cluster's internal shared secret.

    With ``secret`` set, a decode sends it in its registration and a prefill refuses any
    registration that does not carry it (``--internal-token-file``, as on the gRPC worker APIs).
    """

    bootstrap_timeout_s: float = 300.0  # a room without a destination fails after this
    waiting_timeout_s: float = 300.0  # decode: destination sent, no final status after this
    heartbeat_interval_s: float = 5.0
    heartbeat_misses: int = 2  # a peer silent for interval * misses is dead
    quarantine_s: float = 30.0  # decode: hold a failed room's pages this long without an ack
    connect_timeout_s: float = 5.0
    tick_s: float = 0.05  # period of the timeout sweeper
    secret: str | None = field(default=None, repr=False)
    faults: FaultConfig = FaultConfig()  # fault injection (tests, drills); off by default

    def __post_init__(self) -> None:
        """Refuse timings that cannot work: a period or timeout of 0 or less (or nan), a
        negative quarantine, fewer than one heartbeat miss."""
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s",
                     "connect_timeout_s", "tick_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"BootstrapConfig.{name} must be above 0, got "
                                 f"{getattr(self, name)}")
        if not self.quarantine_s >= 0:
            raise ValueError(f"BootstrapConfig.quarantine_s must be at least 0, got "
                             f"{self.quarantine_s}")
        if self.heartbeat_misses < 1:
            raise ValueError(f"BootstrapConfig.heartbeat_misses must be at least 1, got "
                             f"{self.heartbeat_misses}")

    @property
    def peer_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses


@dataclass(frozen=True)
class ModelIdentity:
    """What both nodes must agree on to exchange KV.

    ``num_hidden_layers`` is the target model's layer count: layer ids from it up are the EAGLE
    draft band (:func:`transfer.plan.layers.draft_layer_ids`). A prefill that declares it refuses a
    decode whose draft band differs from its own (one side with a draft, the other without);
    0 declares nothing and skips that check. Nothing new crosses the wire: each side's band is
    read from the layer ids its registration already carries.

    ``pipeline_draft_band`` is set on the stages of a pipeline-parallel prefill: the band of the
    whole pipeline (its last stage runs the draft; empty when none does). A stage checks the
    decode against it, not against its own buffers (which hold no draft before the last stage).

    ``heads``: this node's KV heads over its tensor-parallel ranks, of which this process is
    rank ``tp_rank`` (:mod:`transfer.plan.heads`); None for a node that holds every head. A decode
    publishes them in its registration; a prefill plans the head slice it writes into that
    decode rank from them, or refuses the pair (:func:`check_compatible`).

    ``states``: a hybrid model's linear-attention state geometry over this node's TP ranks
    (:mod:`transfer.plan.states`), None for a model without such layers; checked and planned
    like the heads (:func:`plan_state_sends`).
    """

    model_fingerprint: str
    page_size: int
    dtype: str
    num_hidden_layers: int = 0
    pipeline_draft_band: tuple[int, ...] | None = None
    heads: HeadLayout | None = None
    tp_rank: int = 0
    states: StateLayout | None = None


class SourceRank(Protocol):
    """What the handshake checks of one prefill rank's registered buffers: its
    :class:`~transfer.base.KVManager`, or another TP rank's description
    (:class:`transfer.tp.rank_agent.RemoteRank`)."""

    @property
    def kv_layer_ids(self) -> list[int] | None: ...

    @property
    def kv_ptrs(self) -> list[int]: ...

    @property
    def kv_bytes_per_page(self) -> list[int]: ...

    @property
    def has_staging(self) -> bool: ...

    @property
    def aux(self) -> AuxBuffer | None: ...

    @property
    def state_layer_ids(self) -> list[int]: ...

    @property
    def state_bytes_per_slot(self) -> list[int]: ...


class RankSender(SourceRank, Protocol):
    """A prefill rank the bootstrap server writes through: its own manager, or another rank's
    stand-in on rank 0 (:class:`transfer.tp.rank_agent.RemoteRank`)."""

    def send_kvcache(
        self, session: str, src_pages: Sequence[int], dst_ptrs: Sequence[int],
        dst_pages: Sequence[int], *, dst_layer_ids: Sequence[int] | None = None,
        dst_bytes_per_page: Sequence[int] | None = None, dst_heads: HeadCopy | None = None,
        src_state_slot: int | None = None, dst_state_ptrs: Sequence[int] | None = None,
        dst_state_slot: int | None = None, dst_state_layer_ids: Sequence[int] | None = None,
        dst_state_bytes_per_slot: Sequence[int] | None = None,
        dst_state_copy: StateCopy | None = None,
    ) -> SendResult: ...


def check_token(secret: str | None, reg: Registration) -> None:
    """Raise :class:`PeerAuthError` unless ``reg`` carries ``secret`` (any token when None).

    Constant-time compare; the error names neither token."""
    if secret is not None and not hmac.compare_digest(reg.auth_token.encode(), secret.encode()):
        raise PeerAuthError("registration refused: missing or wrong internal token")


def check_compatible(
    identity: ModelIdentity, manager: SourceRank, reg: Registration
) -> HeadCopy | None:
    """Raise :class:`IncompatiblePeerError` unless the decode's registration fits this prefill;
    return the head slice this prefill rank writes into that decode rank (None: whole pages).

    Checks model fingerprint, page size, dtype, that both hold the same EAGLE draft band (or
    neither has a draft), the KV heads of both sides' TP ranks (:func:`check_heads`), that every
    local layer entry has a destination entry with equal bytes per page (or, head-sliced, the
    bytes per page of the decode rank's heads), and that aux rows have the same size.
    """
    mismatches = [
        (name, mine, theirs)
        for name, mine, theirs in (
            ("model fingerprint", identity.model_fingerprint, reg.model_fingerprint),
            ("page size", identity.page_size, reg.page_size),
            ("dtype", identity.dtype, reg.dtype),
        )
        if mine != theirs
    ]
    if mismatches:
        name, mine, theirs = mismatches[0]
        raise IncompatiblePeerError(f"{name} differs: prefill has {mine!r}, decode has {theirs!r}")
    band = identity.pipeline_draft_band
    if band is None:
        check_draft_band(identity.num_hidden_layers, manager.kv_layer_ids, reg.kv_layer_ids)
    else:
        check_draft_band(identity.num_hidden_layers, [*(manager.kv_layer_ids or []), *band],
                         reg.kv_layer_ids, pipeline=True)
    if not len(reg.kv_ptrs) == len(reg.kv_bytes_per_page):
        raise IncompatiblePeerError("registration has ragged kv_ptrs / kv_bytes_per_page")
    copy = check_heads(identity, manager, reg)
    try:
        pairs = pair_entries(
            manager.kv_layer_ids, reg.kv_layer_ids or None, len(manager.kv_ptrs), len(reg.kv_ptrs)
        )
        if copy is None:
            check_bytes_per_page(pairs, manager.kv_bytes_per_page, reg.kv_bytes_per_page)
        else:
            head_geometry(pairs, manager.kv_bytes_per_page, copy, reg.kv_bytes_per_page)
    except (LayerPairingError, HeadLayoutError) as exc:
        raise IncompatiblePeerError(f"KV layers do not match: {exc}") from exc
    if manager.aux is not None and manager.aux.row_bytes != reg.aux_row_bytes:
        raise IncompatiblePeerError(
            f"aux rows differ: prefill {manager.aux.row_bytes} bytes, decode {reg.aux_row_bytes}"
        )
    return copy


def decode_heads(reg: Registration) -> HeadLayout | None:
    """The decode's KV heads over its TP ranks, as its registration gives them (None: none)."""
    flat = reg.kv_head_ranges
    if not flat:
        return None
    if len(flat) % 2:
        raise IncompatiblePeerError(f"registration has {len(flat)} head-range numbers, not pairs")
    ranges = tuple((flat[k], flat[k + 1]) for k in range(0, len(flat), 2))
    return HeadLayout(reg.num_kv_heads, reg.head_dim, reg.dtype, reg.page_size, ranges)


def check_heads(identity: ModelIdentity, manager: SourceRank, reg: Registration) -> HeadCopy | None:
    """The head slice this prefill rank writes into the registering decode rank: None when
    neither side describes its heads or both hold the same ones (a plain page copy). With
    landing entries in the registration, the slice goes as whole pages into them
    (:func:`check_landing`).

    Raises :class:`IncompatiblePeerError` with the numbers when only one side describes its
    heads, the layouts cannot be paired (:func:`transfer.plan.heads.plan_head_copies`), this rank
    writes nothing into that decode rank (another prefill rank holds its heads), or the slice
    needs a staging buffer this manager did not register.
    """
    dst = decode_heads(reg)
    if identity.heads is None and dst is None:
        return None
    if identity.heads is None or dst is None:
        side = "decode" if identity.heads is None else "prefill"
        raise IncompatiblePeerError(
            f"only the {side} describes its KV heads over TP ranks; both must, or neither"
        )
    if not 0 <= reg.tp_rank < dst.tp_size:
        raise IncompatiblePeerError(f"decode rank {reg.tp_rank} is outside its TP {dst.tp_size}")
    try:
        copies = plan_head_copies(identity.heads, dst, identity.tp_rank)
    except HeadLayoutError as exc:
        raise IncompatiblePeerError(f"KV heads cannot be paired: {exc}") from exc
    mine = [c for c in copies if c.dst_rank == reg.tp_rank]
    if not mine:
        start, count = dst.ranges[reg.tp_rank]
        raise IncompatiblePeerError(
            f"prefill rank {identity.tp_rank} of TP {identity.heads.tp_size} writes none of "
            f"decode rank {reg.tp_rank}'s KV heads [{start}, {start + count}); register it "
            "with the prefill ranks that do (transfer.plan.heads.receivers)"
        )
    (copy,) = mine
    if copy.whole:
        return None
    if reg.landing_ptrs:
        check_landing(manager, reg, copy)
    elif copy.dst_contiguous and not manager.has_staging:
        raise IncompatiblePeerError(
            f"prefill rank {identity.tp_rank} sends {copy.count} of its {copy.src_heads} KV "
            "heads into each page and registered no staging buffer to gather them"
        )
    return copy


def check_draft_band(
    num_hidden_layers: int, prefill_ids: Sequence[int] | None, decode_ids: Sequence[int] | None,
    *, pipeline: bool = False,
) -> None:
    """Raise :class:`IncompatiblePeerError` naming both sides unless the prefill's and the
    decode's layer ids hold the same draft band (ids ``>= num_hidden_layers``); ``pipeline``:
    the prefill is a pipeline, whose last stage takes ``--draft`` (the message says so).

    A decode with a draft fed by a prefill without one would receive no draft KV and draft from
    garbage; the reverse has nowhere to put it. Skipped when ``num_hidden_layers`` is 0 or a side
    publishes no layer ids (positional pairing then compares entry counts).
    """
    if num_hidden_layers <= 0 or not prefill_ids or not decode_ids:
        return
    mine = sorted({i for i in prefill_ids if i >= num_hidden_layers})
    theirs = sorted({i for i in decode_ids if i >= num_hidden_layers})
    if mine != theirs:
        side, who = (("pipeline prefill", "the pipeline's last stage and the decode") if pipeline
                     else ("prefill", "both nodes"))
        raise IncompatiblePeerError(
            f"EAGLE drafts differ: {side} has {_describe_draft(mine)}, decode has "
            f"{_describe_draft(theirs)}; start {who} with the same --draft, or neither"
        )


def _describe_draft(band: list[int]) -> str:
    return f"a draft (KV layer ids {band})" if band else "no draft"


def check_landing(manager: SourceRank, reg: Registration, copy: HeadCopy) -> None:
    """Raise :class:`IncompatiblePeerError` unless the decode's landing entries take this
    prefill rank's pages whole: its slice must be all of its heads, one landing entry per
    decode entry, each with this rank's bytes per page."""
    if not copy.lands:
        raise IncompatiblePeerError(
            f"the decode offers a landing buffer, but this prefill rank sends {copy.count} of "
            f"its {copy.src_heads} KV heads into a rank holding {copy.dst_heads}: only a rank "
            "whose every head lands in a larger decode rank can use one"
        )
    if not len(reg.landing_ptrs) == len(reg.landing_bytes_per_page) == len(reg.kv_ptrs):
        raise IncompatiblePeerError(
            f"registration has {len(reg.landing_ptrs)} landing entries and "
            f"{len(reg.landing_bytes_per_page)} landing sizes for {len(reg.kv_ptrs)} KV entries"
        )
    try:
        pairs = pair_entries(manager.kv_layer_ids, reg.kv_layer_ids or None,
                             len(manager.kv_ptrs), len(reg.kv_ptrs))
        check_bytes_per_page(pairs, manager.kv_bytes_per_page, reg.landing_bytes_per_page)
    except LayerPairingError as exc:
        raise IncompatiblePeerError(f"landing entries do not match: {exc}") from exc


def plan_sends(identity: ModelIdentity, ranks: Sequence[SourceRank],
               reg: Registration) -> list[tuple[int, HeadCopy | None]]:
    """What every rank of a tensor-parallel prefill (``ranks[i]`` is rank ``i``; ``identity``
    is the node's, its heads over all of them) writes into the registering decode rank: the
    ``(index in ranks, head slice)`` of each rank that holds some of its heads (the slice None:
    whole pages), each checked by :func:`check_compatible`; with landing entries, the ``k``-th
    of them writes whole pages into landing slot ``k`` (:func:`landing_slot`). Raises
    :class:`IncompatiblePeerError` as it does. With one entry in ``ranks`` it is the rank
    ``identity.tp_rank`` names (a process that serves its own rank only): ``[(0, copy)]``."""
    if len(ranks) == 1:
        return [(0, check_compatible(identity, ranks[0], reg))]
    src, dst = identity.heads, decode_heads(reg)
    if src is None or dst is None or src.tp_size != len(ranks):
        raise IncompatiblePeerError(
            f"a prefill of {len(ranks)} TP ranks must describe its heads over them, and the "
            "decode its own")
    if not 0 <= reg.tp_rank < dst.tp_size:
        raise IncompatiblePeerError(f"decode rank {reg.tp_rank} is outside its TP {dst.tp_size}")
    try:
        writers = [r for r, _ in receivers(src, dst)[reg.tp_rank]]
    except HeadLayoutError as exc:
        raise IncompatiblePeerError(f"KV heads cannot be paired: {exc}") from exc
    entries = len(reg.kv_ptrs)
    if reg.landing_ptrs and len(reg.landing_ptrs) != len(writers) * entries:
        raise IncompatiblePeerError(
            f"decode rank {reg.tp_rank} offers {len(reg.landing_ptrs)} landing entries; prefill "
            f"ranks {writers} each write part of its heads, which takes {len(writers)} slots of "
            f"{entries}")
    return [(r, check_compatible(dataclasses.replace(identity, tp_rank=r), ranks[r],
                                 landing_slot(reg, slot)))
            for slot, r in enumerate(writers)]


def landing_slot(reg: Registration, slot: int) -> Registration:
    """``reg`` with only landing slot ``slot``'s entries (unchanged without landing entries)."""
    if not reg.landing_ptrs:
        return reg
    part = slice(slot * len(reg.kv_ptrs), (slot + 1) * len(reg.kv_ptrs))
    return dataclasses.replace(reg, landing_ptrs=reg.landing_ptrs[part],
                               landing_bytes_per_page=reg.landing_bytes_per_page[part])


def plan_state_sends(identity: ModelIdentity, ranks: Sequence[SourceRank],
                     reg: Registration) -> list[tuple[int, StateCopy]]:
    """What every rank of the prefill (``ranks[i]`` is rank ``i``, or the one rank
    ``identity.tp_rank`` names) writes of its linear-attention states into the registering
    decode rank's slot: ``(index in ranks, copy)`` of each rank whose share of the heads
    overlaps that rank's (:func:`transfer.plan.states.plan_state_copy`); empty when neither
    side holds states.

    Raises :class:`IncompatiblePeerError` with the numbers when a layer is full attention on
    one side and linear attention on the other, when only one side holds states (a pipeline
    stage may hold none of its decode's), when the geometry differs, when a prefill state
    entry has no decode entry of its layer id, or when an entry's bytes per slot is not its
    layout's."""
    dst = StateLayout.from_list(reg.state_layout) if reg.state_layout else None
    mine = sorted({i for rank in ranks for i in rank.state_layer_ids})
    _check_layer_kinds(ranks, reg)
    src = identity.states
    if src is None or not mine:
        if reg.state_layer_ids and identity.pipeline_draft_band is None:
            raise IncompatiblePeerError(
                f"the decode holds linear-attention states for layers "
                f"{sorted(set(reg.state_layer_ids))}, the prefill none")
        return []
    if dst is None or not reg.state_layer_ids:
        raise IncompatiblePeerError(
            f"the prefill holds linear-attention states for layers {mine}, the decode none")
    single = len(ranks) == 1
    out = []
    for index, rank in enumerate(ranks):
        src_rank = identity.tp_rank if single else index
        copy = plan_state_copy(src, dst, src_rank, reg.tp_rank)
        if copy.empty:
            continue
        _check_state_entries(rank, src, reg, dst)
        out.append((index, copy))
    return out


def _check_layer_kinds(ranks: Sequence[SourceRank], reg: Registration) -> None:
    """Refuse a layer id that is KV (full attention) on one side and a state on the other."""
    for rank in ranks:
        for side, kv, states in (("prefill", rank.kv_layer_ids or [], reg.state_layer_ids),
                                 ("decode", reg.kv_layer_ids, rank.state_layer_ids)):
            both = sorted(set(kv) & set(states))
            if both:
                other = "decode" if side == "prefill" else "prefill"
                raise IncompatiblePeerError(
                    f"layer {both[0]} is full attention on the {side} and linear attention on "
                    f"the {other}: the two sides run different models")


def _check_state_entries(rank: SourceRank, src: StateLayout, reg: Registration,
                         dst: StateLayout) -> None:
    """Every state entry of ``rank`` pairs with a decode entry of its id, each side's of its
    layout's size."""
    if not len(reg.state_ptrs) == len(reg.state_bytes_per_slot) == len(reg.state_layer_ids):
        raise IncompatiblePeerError("registration has ragged state entries")
    try:
        pairs = pair_entries(rank.state_layer_ids, reg.state_layer_ids,
                             len(rank.state_layer_ids), len(reg.state_layer_ids))
        src_kinds, dst_kinds = entry_kinds(rank.state_layer_ids), entry_kinds(reg.state_layer_ids)
    except LayerPairingError as exc:
        raise IncompatiblePeerError(f"linear-attention states do not match: {exc}") from exc
    for i, j in pairs:
        for side, layout, size, kind in (
                ("prefill", src, rank.state_bytes_per_slot[i], src_kinds[i]),
                ("decode", dst, reg.state_bytes_per_slot[j], dst_kinds[j])):
            if size != layout.entry_bytes(kind):
                raise IncompatiblePeerError(
                    f"{side} state entry of layer {rank.state_layer_ids[i]} has {size} bytes "
                    f"per slot, its layout {layout.entry_bytes(kind)}")
