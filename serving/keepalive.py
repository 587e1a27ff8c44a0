"""gRPC keepalive of every connection between pdserve's processes, set in this one place.

Without keepalive a connection whose peer vanished without a word (a partition, a host that
lost power: no FIN, no RST) looks healthy until something is sent on it and TCP gives up
retransmitting, which takes about 15 minutes; an idle one lingers forever. A stream on it (a
decode's token stream to the router, the router's ``Prefill`` call) hangs until its deadline,
and whatever the peer holds for it stays held. So every channel one node opens to another
(router -> prefill and decode workers, a pipeline stage -> the next stage, the ``pdserve
client`` -> the router) and every server pings its peer every :attr:`Keepalive.time_s` and
closes the connection when a ping is not answered within :attr:`Keepalive.timeout_s`: its calls
end ``UNAVAILABLE`` on the channel's side (the router then recovers: :mod:`router.recovery`)
and are cancelled on the server's side (the node frees what the call held). gRPC also sets
``TCP_USER_TIMEOUT`` to the timeout on these sockets, so data left unacknowledged that long
closes the connection too.

Both sides ping whether or not calls are open (``keepalive_permit_without_calls``) and without
a limit on pings between data frames (``http2.max_pings_without_data`` 0: gRPC's default stops
after 2). A server refuses a client that pings more often than its
``http2.min_ping_interval_without_data_ms`` (gRPC's default: every 5 minutes) with a GOAWAY
(``too_many_pings``) after two such pings; pdserve's servers accept pings every
:data:`MIN_TIME_S`, the shortest ``--keepalive-time-s`` takes, so nodes with different settings
never refuse each other.

Defaults: :data:`TIME_S` 5 s and :data:`TIMEOUT_S` 5 s, so a dead peer is found within about
10 s, the same bound as the KV handshake's heartbeat (``--heartbeat-interval-s`` 5 s, dead after
2 silent periods); a ping every 5 s on an idle connection costs nothing measurable.
``--keepalive-time-s`` and ``--keepalive-timeout-s`` on ``pdserve router``, ``prefill`` and
``decode`` change them.
"""

from __future__ import annotations

from dataclasses import dataclass

TIME_S = 5.0  # ping a peer after this long (default of --keepalive-time-s)
TIMEOUT_S = 5.0  # close the connection when the ping's answer takes longer than this
MIN_TIME_S = 1.0  # the shortest --keepalive-time-s; every server accepts pings this often
MIN_TIMEOUT_S = 0.1  # the shortest --keepalive-timeout-s
MAX_S = 86400.0  # the longest of either (gRPC takes milliseconds as a 32-bit integer)
Options = list[tuple[str, int]]


@dataclass(frozen=True)
class Keepalive:
    """How often a connection's peer is pinged (``time_s``) and how long its answer may take
    (``timeout_s``) before the connection is closed; see the module docstring."""

    time_s: float = TIME_S
    timeout_s: float = TIMEOUT_S

    def __post_init__(self) -> None:
        """Refuse a ping period outside [:data:`MIN_TIME_S`, :data:`MAX_S`] (below it, servers
        would refuse the pings) and a timeout outside [:data:`MIN_TIMEOUT_S`, :data:`MAX_S`]."""
        for flag, value, low in (("time", self.time_s, MIN_TIME_S),
                                 ("timeout", self.timeout_s, MIN_TIMEOUT_S)):
            if not low <= value <= MAX_S:
                raise ValueError(f"--keepalive-{flag}-s must be in [{low:g}, {MAX_S:g}], got "
                                 f"{value:g}")

    def _pings(self) -> Options:
        return [("grpc.keepalive_time_ms", _ms(self.time_s)),
                ("grpc.keepalive_timeout_ms", _ms(self.timeout_s)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]

    def channel_options(self) -> Options:
        """The options of a channel to another node (or to the router)."""
        return self._pings()

    def server_options(self) -> Options:
        """The options of a node's server: it pings its clients as a channel does, and accepts
        their pings every :data:`MIN_TIME_S`, with or without calls open."""
        return [*self._pings(),
                ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_TIME_S))]


DEFAULT_KEEPALIVE = Keepalive()  # the flags' defaults


def _ms(seconds: float) -> int:
    return round(seconds * 1000)
