"""The test hosts themselves: they reach each other over their addresses and leave the machine's
own networking alone; each link's delay, loss and cut act on real traffic and change while it
flows; teardown kills and deletes everything, also after a failure; leftovers of a dead run go.

Traffic comes from small probe programs run inside the namespaces (a TCP echo and a UDP sink).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from bench.netns_hosts import PREFIX, Host, Hosts, cleanup_leftovers, unavailable

ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 9100))
print("up", flush=True)
while True:
    c, _ = s.accept()
    while d := c.recv(64):
        c.sendall(d)
"""
# round trips of one byte on one connection, "t_ms rtt_ms" per line, for argv[2] seconds
RTT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 9100), timeout=2)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t0 = time.monotonic()
while time.monotonic() - t0 < float(sys.argv[2]):
    t = time.monotonic()
    c.sendall(b"x")
    c.recv(1)
    print(f"{(t - t0) * 1e3:.1f} {(time.monotonic() - t) * 1e3:.3f}", flush=True)
    time.sleep(0.01)
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""
UDP_SINK = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9101))
s.settimeout(1.0)
print("up", flush=True)
n = 0
try:
    while True:
        s.recv(64)
        n += 1
except TimeoutError:
    print(n)
"""
UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"x", (sys.argv[1], 9101))
    time.sleep(0.0005)
"""


def _server(host: Host, program: str) -> subprocess.Popen[bytes]:
    """Start ``program`` on ``host`` (its address as argv[1]); returns once it says "up"."""
    proc = host.popen([sys.executable, "-c", program, host.address], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def _rtts(client: Host, server: Host, seconds: float) -> list[tuple[float, float]]:
    """(start ms, round-trip ms) of each probe of one connection during ``seconds``."""
    out = client.run([sys.executable, "-c", RTT, server.address, str(seconds)])
    return [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


def _connect(client: Host, server: Host, port: int = 9100) -> str:
    return client.run([sys.executable, "-c", CONNECT, server.address, str(port)]).strip()


def _root_network() -> str:
    """The machine's own interfaces, addresses and routes."""
    return "".join(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                   for cmd in (["ip", "-o", "link"], ["ip", "-o", "addr"],
                               ["ip", "route", "show", "table", "all"]))


@pytest.fixture
def two(make_hosts: Callable[[int], Hosts]) -> Iterator[Hosts]:
    """Two hosts with a TCP echo server on the second."""
    hosts = make_hosts(2)
    _server(hosts[1], ECHO)
    yield hosts


def test_unavailable_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert unavailable() == "network namespaces need root (this process runs as uid 1000)"


def test_hosts_reach_each_other_and_leave_the_machine_alone(netns_ready: None) -> None:
    before = _root_network()
    with Hosts(3) as hosts:
        assert _root_network() == before  # the bridge lives in a namespace of its own
        assert len({h.address for h in hosts}) == 3
        assert all(h.address.startswith("10.77.") for h in hosts)
        links = hosts[0].run(["ip", "-o", "link"])
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == \
            ["lo", "eth0"]
        _server(hosts[2], ECHO)
        assert _connect(hosts[0], hosts[2]) == "connected"
        assert _connect(hosts[1], hosts[2]) == "connected"
    assert _root_network() == before


def test_delay_changes_on_an_open_connection(two: Hosts) -> None:
    """5 ms on both hosts for half a second in the middle of one connection's probes: those
    round trips take 10 ms more; before and after, well under that."""
    a, b = two
    client = a.popen([sys.executable, "-c", RTT, b.address, "1.5"], stdout=subprocess.PIPE)
    assert client.stdout is not None
    before = [float(client.stdout.readline().split()[1]) for _ in range(5)]
    a.link.set(delay_ms=5)
    b.link.set(delay_ms=5, jitter_ms=1)
    time.sleep(0.5)
    a.link.set()
    b.link.set()
    out, _ = client.communicate(timeout=10)
    assert client.returncode == 0
    rtts = [float(line.split()[1]) for line in out.decode().splitlines()]
    assert min(before) < 5.0
    assert sum(1 for r in rtts if r >= 9.0) >= 10  # the delayed stretch, ~25 probes of it
    assert min(rtts[-10:]) < 5.0  # gone again


def test_loss_drops_that_share_of_the_packets(two: Hosts) -> None:
    """Half the datagrams go; while there is loss the host sends MTU-sized packets only (no
    64 KiB TSO segments, whose loss would take out dozens of wire packets at once)."""
    a, b = two
    assert _connect(a, b) == "connected"  # both know each other's MAC before the loss
    sink = _server(b, UDP_SINK)
    a.link.set(loss_pct=50)
    assert "gso_max_segs 1 " in a.run(["ip", "-d", "link", "show", "eth0"])
    a.run([sys.executable, "-c", UDP_SEND, b.address, "400"])
    out, _ = sink.communicate(timeout=10)
    received = int(out)
    assert 100 < received < 300, received  # 200 expected, sd 10
    assert a.link.dropped() >= 400 - received
    a.link.set()
    assert "gso_max_segs 65535 " in a.run(["ip", "-d", "link", "show", "eth0"])
    assert _connect(a, b) == "connected"


def test_cut_is_silent_both_ways_until_heal(two: Hosts) -> None:
    """A cut link drops everything both ways, and neither host is told: a connect times out
    (no "network unreachable", no reset); healed, it connects again."""
    a, b = two
    _server(a, ECHO)
    a.link.cut()
    assert _connect(a, b) == "TimeoutError"
    assert _connect(b, a) == "TimeoutError"
    assert a.link.dropped() > 0
    assert "state UP" in a.run(["ip", "link", "show", "eth0"])
    a.link.heal()
    assert _connect(a, b) == "connected"
    assert _connect(b, a) == "connected"


def test_cut_between_two_hosts_leaves_the_others(make_hosts: Callable[[int], Hosts]) -> None:
    """``a.link.cut(b)`` partitions a and b only: their connects time out both ways, while
    each still reaches c; a second ``cut(c)`` adds c; heal ends both. The loss of a's link
    still acts on what the cut lets through (the cut goes ahead of it, not instead)."""
    a, b, c = make_hosts(3)
    for host in (a, b, c):
        _server(host, ECHO)
    a.link.cut(b)
    assert a.link.cut_from == (b.address,)
    assert _connect(a, b) == "TimeoutError" and _connect(b, a) == "TimeoutError"
    for x, y in ((a, c), (c, a), (b, c), (c, b)):
        assert _connect(x, y) == "connected", (x.address, y.address)
    a.link.set(loss_pct=50)
    sink = _server(c, UDP_SINK)
    a.run([sys.executable, "-c", UDP_SEND, c.address, "400"])
    out, _ = sink.communicate(timeout=10)
    assert 100 < int(out) < 300, out  # 200 expected, sd 10
    a.link.set()  # a new shape keeps the cut
    a.link.cut(c)
    assert a.link.cut_from == (b.address, c.address)
    assert _connect(a, b) == "TimeoutError"
    assert _connect(a, c) == "TimeoutError" and _connect(b, c) == "connected"
    a.link.heal()
    assert a.link.cut_from == ()
    assert _connect(a, b) == "connected" and _connect(b, a) == "connected"
    assert _connect(a, c) == "connected"


def test_shape_survives_a_cut(two: Hosts) -> None:
    """A link cut with a delay set keeps the delay after heal."""
    a, b = two
    a.link.set(delay_ms=10)
    a.link.cut()
    a.link.heal()
    rtts = _rtts(a, b, 0.2)
    assert min(r for _, r in rtts) >= 10.0


def test_close_kills_and_deletes_everything_after_a_failure(netns_ready: None) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Hosts(2) as hosts:
        names = {hosts.bridge_ns, *(h.netns for h in hosts)}
        sleeper = hosts[0].popen(["sleep", "60"])
        hosts[1].link.set(delay_ms=1)  # a delay line process as well
        raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in names if name in listed]


def test_cleanup_deletes_the_namespaces_of_dead_runs_only(netns_ready: None) -> None:
    gone_run = subprocess.Popen(["true"])
    gone_run.wait()
    dead, live = f"{PREFIX}-{gone_run.pid}-0-h0", f"{PREFIX}-{os.getpid()}-999-h0"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert dead in cleanup_leftovers()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert dead not in listed and live in listed
    finally:
        for name in (dead, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
