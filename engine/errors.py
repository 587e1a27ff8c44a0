"""Errors the engine raises for bad input or bad files.

Every error a user can cause derives from :class:`EngineError` and carries a message meant to be
shown as is (the servers map :class:`InvalidRequestError` to ``INVALID_ARGUMENT``).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of all errors the engine raises on purpose."""


class ConfigError(EngineError):
    """A model directory or ``config.json`` that the engine cannot serve."""


class CheckpointError(EngineError):
    """Missing, corrupt or mismatched weight files."""


class InvalidRequestError(EngineError):
    """A request the engine refuses: empty or too long prompt, bad images, bad sampling values."""


class DuplicateRequestError(InvalidRequestError):
    """A request id (a room id, on the workers) that is already running here. The servers answer
    ``ALREADY_EXISTS``: the same request under a new id is welcome (a router draws another room
    id)."""


class OutOfPagesError(EngineError):
    """The page allocator has fewer free pages than asked for."""


class DeviceError(ConfigError):
    """A ``--device`` / ``--dtype`` this machine cannot run: an unknown name, a missing runtime
    (a CUDA build of torch, ``torch_npu``) or no visible device. The message is one line that
    names what to install or check."""


class TensorParallelError(EngineError):
    """A tensor-parallel rank failed (it raised, or its process died): the message names the
    rank and what it reported. The engine cannot step after it; close it and build a new one."""


class OutOfStateSlotsError(OutOfPagesError):
    """Every state slot is owned by a running request. A kind of :class:`OutOfPagesError`: the
    node has no room for another request now (the servers answer ``RESOURCE_EXHAUSTED``)."""
