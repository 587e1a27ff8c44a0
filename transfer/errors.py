"""Errors of the transfer layer. Every one carries a message meant to be shown as is."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of all errors the transfer layer raises on purpose."""


class LayerPairingError(TransferError):
    """Source and destination buffer entries cannot be paired; raised before any byte moves."""


class PageListError(TransferError):
    """Bad page lists (unequal lengths, negative or out-of-range ids); raised before any byte
    moves."""


class EngineCallError(TransferError):
    """The transfer engine refused or failed a call."""


class BackendUnavailableError(TransferError):
    """A backend's runtime (NPU driver, ``torch_npu``, the engine build) is not installed."""


class MessageError(TransferError):
    """A message that is malformed, of an unknown version or type, or over the size limit."""


class IncompatiblePeerError(TransferError):
    """The prefill and decode nodes cannot be paired (model, page size, dtype or layers differ)."""


class PeerAuthError(TransferError):
    """A bootstrap registration without the cluster's internal shared secret (or a wrong one)."""


class HeadLayoutError(TransferError):
    """The two sides' KV head layouts (TP sizes, head ranges, head geometry) cannot be paired
    for a head-sliced transfer; raised before any byte moves."""
