"""Built-in fault injection for tests and drills; off by default and free when off.

A node's faults are a :class:`FaultConfig` (flags ``--fault-*`` of prefill and decode nodes, each
defaulting to its ``PDSERVE_FAULT_*`` environment variable). When any fault is on, the node's KV
manager carries a :class:`FaultInjector` (``KVManager.faults``; ``None`` when off, so the hooks
cost one attribute test):

* ``transfer_fail_p``: each engine write fails with that probability, returning
  :data:`INJECTED_ERROR_CODE` instead of moving bytes, so it takes exactly the path of an engine
  network error (:class:`~transfer.errors.EngineCallError`, the room fails, not quiesced).
* ``slow_peer_s``: every engine write first sleeps that long (a slow or congested peer).
* ``drop_handshake_p``: each per-room handshake message this node sends (``Destination``,
  ``Status``, ``Abort``, ``AbortAck``) is dropped with that probability; the peers' timeouts
  must end the room. Registration and heartbeats are never dropped.
* ``status_delay_s``: a prefill holds each ``Status`` that long before sending it.

Every injected failure, drop and delay is counted (``faults_injected`` in ``Admin.GetStats``), so a
test can tell injected failures from lost requests.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from transfer.bootstrap.messages import Abort, AbortAck, Destination, Message, Status

INJECTED_ERROR_CODE = -900  # what an injected engine failure returns (Mooncake errors are < 0)
ENV_PREFIX = "PDSERVE_FAULT_"
_ROOM_MESSAGES = (Destination, Status, Abort, AbortAck)
Write = Callable[[str, list[int], list[int], list[int]], int]


@dataclass(frozen=True)
class FaultConfig:
    """Which faults a node injects; every field at its default means none."""

    transfer_fail_p: float = 0.0  # probability that one engine write fails
    status_delay_s: float = 0.0  # prefill: hold every Status this long
    drop_handshake_p: float = 0.0  # probability of dropping one per-room handshake message
    slow_peer_s: float = 0.0  # sleep before every engine write
    seed: int | None = None  # seed of the draws (None: a fresh random seed)

    def __post_init__(self) -> None:
        for name in ("transfer_fail_p", "drop_handshake_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within 0..1, got {getattr(self, name)}")
        for name in ("status_delay_s", "slow_peer_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return any((self.transfer_fail_p, self.status_delay_s, self.drop_handshake_p,
                    self.slow_peer_s))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FaultConfig:
        """The faults named by ``PDSERVE_FAULT_<FIELD>`` variables (e.g.
        ``PDSERVE_FAULT_TRANSFER_FAIL_P=0.01``, ``PDSERVE_FAULT_SEED=7``)."""
        seed = _env_number(env, "seed", int)
        return cls(
            transfer_fail_p=_env_number(env, "transfer_fail_p", float) or 0.0,
            status_delay_s=_env_number(env, "status_delay_s", float) or 0.0,
            drop_handshake_p=_env_number(env, "drop_handshake_p", float) or 0.0,
            slow_peer_s=_env_number(env, "slow_peer_s", float) or 0.0,
            seed=None if seed is None else int(seed),
        )


def _env_number(env: Mapping[str, str], field: str, kind: type[float] | type[int]
                ) -> float | None:
    """``PDSERVE_FAULT_<FIELD>`` as ``kind`` (None when unset or empty)."""
    name = ENV_PREFIX + field.upper()
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from exc


class FaultInjector:
    """Draws and counts the faults of one :class:`FaultConfig`; safe from any thread."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self.injected = 0  # failed writes + dropped messages + delayed statuses

    def _draw(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            hit = self._rng.random() < p
            self.injected += hit
            return hit

    def write(self, write: Write, session: str, srcs: list[int], dsts: list[int],
              lens: list[int]) -> int:
        """One engine batch write through ``write``, slowed and possibly failed."""
        if self.config.slow_peer_s:
            time.sleep(self.config.slow_peer_s)
        if self._draw(self.config.transfer_fail_p):
            return INJECTED_ERROR_CODE
        return write(session, srcs, dsts, lens)

    def outgoing(self, msgs: Sequence[Message]) -> list[Message]:
        """The handshake messages that go out of ``msgs`` (a batch about to be sent, on a
        thread that may wait): delays a batch holding a ``Status``, drops room messages."""
        if self.config.status_delay_s and any(isinstance(m, Status) for m in msgs):
            with self._lock:
                self.injected += 1
            time.sleep(self.config.status_delay_s)
        return [m for m in msgs if not (isinstance(m, _ROOM_MESSAGES)
                                        and self._draw(self.config.drop_handshake_p))]


def make_injector(config: FaultConfig | None) -> FaultInjector | None:
    """An injector for ``config``, or None when it injects nothing."""
    return FaultInjector(config) if config is not None and config.enabled else None


def fault_figures(faults: FaultInjector | None) -> dict[str, int]:
    """A node's ``faults_injected`` figure for ``Admin.GetStats`` (none when injection is off)."""
    return {} if faults is None else {"faults_injected": faults.injected}
