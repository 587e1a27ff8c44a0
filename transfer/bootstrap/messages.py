"""Every message that crosses the prefill/decode bootstrap boundary, as typed classes.

Encoding: msgpack of ``[VERSION, type name, {field: value}]``. Decoding is strict: the version
must match, the type must be known, the field set must be exactly the class's fields and every
value must have the declared type (``bool`` is not accepted as ``int``). Payloads larger than
``MAX_MESSAGE_BYTES`` are refused before they are parsed.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from transfer.errors import MessageError
from transfer.status import KVPoll

VERSION = 5
MAX_MESSAGE_BYTES = 8 << 20


@dataclass(frozen=True)
class Registration:
    """What a decode node publishes once per connection: where its KV and aux rows live.

    ``kv_ptrs``, ``kv_bytes_per_page`` and ``kv_layer_ids`` are parallel, one item per buffer
    entry (``[K_0..K_{L-1}, V_0..V_{L-1}]``); ``kv_layer_ids`` holds global layer ids.
    ``auth_token`` is the cluster's internal shared secret ("" without one): a prefill that has
    one refuses a registration without it (:func:`transfer.bootstrap.handshake.check_token`). It is
    kept out of ``repr`` so that it never reaches a log.

    Tensor parallelism (:mod:`transfer.plan.heads`): ``tp_rank`` is this decode rank and
    ``kv_head_ranges`` the ``(start, count)`` of the KV heads of every rank of the decode,
    flattened (``[start_0, count_0, start_1, count_1, ...]``), of ``num_kv_heads`` heads of
    ``head_dim``; empty ranges (and zeros) mean a decode that holds every head and says nothing
    about them. ``landing_ptrs`` / ``landing_bytes_per_page``: this decode rank's landing
    entries, one slot per prefill rank that writes a slice of its heads (those ranks in rank
    order), each slot's entries parallel to ``kv_layer_ids``, each of ``landing_num_pages``
    pages; empty when the prefill writes into the pool itself.

    A hybrid model's linear-attention layers (:mod:`transfer.plan.states`): ``state_ptrs``,
    ``state_bytes_per_slot`` and ``state_layer_ids`` are parallel, one item per state entry
    (``[conv_0..conv_{L-1}, rec_0..rec_{L-1}]``, global layer ids), each of
    ``num_state_slots`` slots; ``state_layout`` is
    :meth:`~transfer.plan.states.StateLayout.to_list` of their geometry over the decode's TP
    ranks. All empty (and 0) for a model without linear-attention layers. A layer id is in
    ``kv_layer_ids`` or in ``state_layer_ids``, never both: that is the layer-kind map.
    """

    session_id: str  # transfer engine address of the decode, "host:rpc_port"
    kv_ptrs: list[int]
    kv_bytes_per_page: list[int]
    kv_layer_ids: list[int]
    num_pages: int
    aux_ptr: int
    aux_row_bytes: int
    aux_num_rows: int
    page_size: int
    dtype: str
    model_fingerprint: str
    auth_token: str = dataclasses.field(default="", repr=False)
    tp_rank: int = 0
    kv_head_ranges: list[int] = dataclasses.field(default_factory=list)
    num_kv_heads: int = 0
    head_dim: int = 0
    landing_ptrs: list[int] = dataclasses.field(default_factory=list)
    landing_bytes_per_page: list[int] = dataclasses.field(default_factory=list)
    landing_num_pages: int = 0
    state_ptrs: list[int] = dataclasses.field(default_factory=list)
    state_bytes_per_slot: list[int] = dataclasses.field(default_factory=list)
    state_layer_ids: list[int] = dataclasses.field(default_factory=list)
    num_state_slots: int = 0
    state_layout: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class RegisterReply:
    """The prefill's answer to a registration; ``ok=False`` carries the refusal reason.

    ``prefill_head_ranges``: the prefill's KV heads over its TP ranks, flattened as
    ``Registration.kv_head_ranges`` (empty: it describes none). A decode rank that several
    prefill ranks each fill a slice of learns here how to register with a landing slot per
    rank (:mod:`transfer.plan.heads`). ``prefill_layer_ids``: the layer ids of the prefill's KV
    entries (a pipeline stage's, its draft band's), the only entries it writes."""

    ok: bool
    reason: str
    prefill_head_ranges: list[int] = dataclasses.field(default_factory=list)
    prefill_layer_ids: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Destination:
    """Where one room's KV goes on the decode: page ids in prompt order and the aux row slot.

    ``cached_pages``: the room's first prompt pages that the decode holds already (its prefix
    cache). The prefill sends none of them: ``pages`` are the destinations of the prompt's pages
    from that index on (delta transfer). ``landing_pages``: with a landing buffer
    (:mod:`transfer.plan.heads`), the landing pages the prefill writes instead, one per page of
    ``pages``; the decode scatters them into ``pages`` on ``Success``. ``state_slot``: the
    decode's state slot the prompt's final linear-attention states go into (a hybrid model;
    -1 without states)."""

    room: int
    pages: list[int]
    aux_slot: int
    cached_pages: int = 0
    landing_pages: list[int] = dataclasses.field(default_factory=list)
    state_slot: int = -1


@dataclass(frozen=True)
class Status:
    """Prefill to decode: a room's status. ``quiesced`` promises no more writes into its pages."""

    room: int
    status: int  # a KVPoll value
    reason: str
    quiesced: bool


@dataclass(frozen=True)
class Abort:
    """Either direction: give up on ``room``."""

    room: int
    reason: str


@dataclass(frozen=True)
class AbortAck:
    """Prefill to decode: the prefill will write nothing more into ``room``'s pages."""

    room: int


@dataclass(frozen=True)
class Heartbeat:
    """Decode to prefill liveness probe; answered with :class:`HeartbeatAck` of the same seq."""

    seq: int


@dataclass(frozen=True)
class HeartbeatAck:
    """Prefill to decode answer to :class:`Heartbeat`."""

    seq: int


@dataclass(frozen=True)
class RankBuffers:
    """Within a tensor-parallel prefill: what another rank's process registered (its engine's
    address, its KV entries, whether it has a staging buffer, its state entries) and the port
    of its send agent (:mod:`transfer.tp.rank_agent`), reported to rank 0 once."""

    session_id: str
    kv_ptrs: list[int]
    kv_bytes_per_page: list[int]
    kv_layer_ids: list[int]
    num_pages: int
    has_staging: bool
    agent_port: int
    state_layer_ids: list[int] = dataclasses.field(default_factory=list)
    state_bytes_per_slot: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class SendOrder:
    """Rank 0 of a tensor-parallel prefill to another rank: make this ``send_kvcache`` call
    (``dst_layer_ids`` empty: positional pairing; ``heads`` empty: whole pages, else the
    :class:`~transfer.plan.heads.HeadCopy` fields in order; ``src_state_slot`` -1: no states,
    else the state keywords, ``state_copy`` empty for whole entries, else
    :meth:`~transfer.plan.states.StateCopy.to_list`)."""

    session_id: str
    src_pages: list[int]
    dst_ptrs: list[int]
    dst_pages: list[int]
    dst_layer_ids: list[int]
    dst_bytes_per_page: list[int]
    heads: list[int]
    src_state_slot: int = -1
    dst_state_ptrs: list[int] = dataclasses.field(default_factory=list)
    dst_state_slot: int = -1
    dst_state_layer_ids: list[int] = dataclasses.field(default_factory=list)
    dst_state_bytes_per_slot: list[int] = dataclasses.field(default_factory=list)
    state_copy: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class SendReply:
    """The rank's answer to a :class:`SendOrder`: what moved, or why not (``error``: the
    :mod:`transfer.errors` class its manager raised, ``EngineCallError`` when bytes may have
    landed)."""

    ok: bool
    error: str
    reason: str
    blocks: int
    batches: int
    nbytes: int


@dataclass(frozen=True)
class LandingOrder:
    """Rank 0 of a tensor-parallel decode to another rank: make (or find) a landing buffer of
    ``num_pages`` pages with one slot per slice ``(head_start, count)`` of that rank's heads
    (flattened) and register it (:mod:`decode_node.rank_landing`)."""

    slices: list[int]
    num_pages: int


@dataclass(frozen=True)
class LandingReply:
    """The rank's landing buffer ``landing_id`` on ``device``: its entries, every slot's in slot
    order, each slot's parallel to the rank's ``kv_layer_ids`` (empty with ``reason`` when it
    failed)."""

    landing_id: int
    landing_ptrs: list[int]
    landing_bytes_per_page: list[int]
    device: str
    reason: str


@dataclass(frozen=True)
class ScatterOrder:
    """Rank 0 of a tensor-parallel decode to another rank: scatter landing pages of buffer
    ``landing_id`` into pool ``pages`` (``slot`` -1: every slot; ``layer_ids`` empty: every
    layer), as :meth:`engine.kv.staging.HeadLandingBuffer.scatter`."""

    landing_id: int
    landing_pages: list[int]
    pages: list[int]
    slot: int
    layer_ids: list[int]


@dataclass(frozen=True)
class ScatterReply:
    """The rank's answer to a :class:`ScatterOrder` (``reason`` empty: done)."""

    reason: str


Message = typing.Union[  # noqa: UP007 (a runtime alias)
    Registration, RegisterReply, Destination, Status, Abort, AbortAck, Heartbeat, HeartbeatAck,
    RankBuffers, SendOrder, SendReply, LandingOrder, LandingReply, ScatterOrder, ScatterReply,
]
_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Registration, RegisterReply, Destination, Status, Abort, AbortAck, Heartbeat, HeartbeatAck,
        RankBuffers, SendOrder, SendReply, LandingOrder, LandingReply, ScatterOrder,
        ScatterReply,
    )
}


class _Schema:
    """Field name to a checker, built once per message class from its type hints."""

    cache: ClassVar[dict[type, dict[str, Any]]] = {}

    @classmethod
    def of(cls, msg_type: type) -> dict[str, Any]:
        if msg_type not in cls.cache:
            hints = typing.get_type_hints(msg_type)
            cls.cache[msg_type] = {f.name: hints[f.name] for f in dataclasses.fields(msg_type)}
        return cls.cache[msg_type]


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    raise TypeError(f"unsupported field type {hint}")


def encode(msg: Message) -> bytes:
    """Serialize one message; raises :class:`MessageError` if it exceeds the size limit."""
    name = type(msg).__name__
    if name not in _TYPES:
        raise MessageError(f"not a bootstrap message: {type(msg)!r}")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    data = msgpack.packb([VERSION, name, fields], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{name} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes) -> Message:
    """Parse and strictly validate one message (version, type, exact fields, value types)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {exc}") from exc
    if not (isinstance(obj, list) and len(obj) == 3):
        raise MessageError("message is not a [version, type, fields] triple")
    version, name, fields = obj
    if type(version) is not int or version != VERSION:  # True and 1.0 are not version 1
        raise MessageError(f"message version {version!r} is not {VERSION}")
    msg_type = _TYPES.get(name) if isinstance(name, str) else None
    if msg_type is None:
        raise MessageError(f"unknown message type {name!r}")
    schema = _Schema.of(msg_type)
    if not isinstance(fields, dict) or set(fields) != set(schema):
        got = sorted(map(repr, fields)) if isinstance(fields, dict) else type(fields).__name__
        raise MessageError(f"{name} fields {got} are not {sorted(schema)}")
    for key, hint in schema.items():
        if not _type_ok(fields[key], hint):
            raise MessageError(f"{name}.{key} has a value of the wrong type: {fields[key]!r:.80}")
    if msg_type is Status and fields["status"] not in set(KVPoll):
        raise MessageError(f"Status.status {fields['status']} is not a KVPoll value")
    return msg_type(**fields)
