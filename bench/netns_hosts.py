"""Hosts on one machine (Linux network namespaces on a bridge), and KV transfer between them.

**Hosts.** :class:`Hosts` builds N hosts: each a network namespace with its loopback up and one
veth pair whose other end is a port of a bridge that lives in a namespace of its own, so the
machine's own namespace gets no interface, address or route. Host ``i`` has the address
``10.77.K.(i+1)/24`` (the first such subnet that overlaps no route of the machine; each set
of hosts is a network of its own, so two sets may have the same addresses). Every
namespace is named ``pdsn-<pid>-<n>-...`` after the process that made it;
:func:`cleanup_leftovers` deletes those of processes that no longer run (a crashed run).
:meth:`Host.run`, :meth:`Host.popen` (``ip netns exec``) and :meth:`Host.spawn` (a Python
function in a ``spawn`` child that enters the namespace first) run processes on a host;
:meth:`Hosts.close` kills whatever still runs in the namespaces and deletes them.

**Links.** Each host's :class:`Link` shapes what the host *sends*, the way ``tc netem`` on an
interface shapes its egress, and every setting can change while traffic flows. This kernel has
no ``sch_netem`` (nor ``tbf``/``fq``/``gact``), so the link is built from what it has:

- rate: an HTB class on the host's interface (the host's NIC is that fast; TCP sees the queue);
- loss: a classic-BPF ``tc`` filter in direct-action mode on the bridge's port, dropping each
  packet the host sent with the given probability (``ld rand``), in the network, not the host.
  A host's TCP hands its interface segments of up to 64 KiB (TSO), and on veth they stay whole
  on the "wire", so while a link has loss its host sends one MTU-sized packet at a time
  (``gso_max_segs 1``, the route cache flushed so open connections follow): the probability is
  per wire packet, as on a real link, at a cost in CPU (a send is many times slower);
- delay and jitter: a delay line (:func:`_delay_line`, a process in the host's namespace, at
  real-time priority where allowed) behind a TUN device; a policy-routing rule sends the host's
  own outgoing packets through it, it holds each one for the delay (plus a uniform jitter, in
  order: no reordering) and writes it back, and the host forwards it out of its interface.
  Large (GSO) packets go through whole; delay 0 takes the rule away, so unshaped traffic never
  passes through Python;
- :meth:`Link.cut`: the same filters drop every packet in both directions at the bridge's port.
  Both hosts' interfaces stay up and neither stack learns anything (no carrier change, no route
  removed, no ICMP): a partition in the network, found only by timeouts and keepalives, not an
  unplugged cable (a link set down answers ``ENETUNREACH`` at once). ``cut(peer, ...)`` drops
  only the IPv4 packets between the host and those peers (by address, both ways, ahead of the
  link's loss), so the host still reaches every other: a partition between two hosts of one
  network. :meth:`Link.heal` ends every cut and puts the link's own loss back.

A delay of ``d`` on both hosts of a pair adds ``2 d`` to their round trip.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import itertools
import multiprocessing as mp
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

PREFIX = "pdsn"  # every namespace made here is PREFIX-<pid>-<n>-<role>
NETNS_DIR = "/var/run/netns"  # where `ip netns add` keeps its namespaces
BRIDGE = "br0"
HOST_IF = "eth0"  # each host's interface
DELAY_IF = "dly0"  # each host's delay line (TUN)
DELAY_TABLE = 101  # routing table that sends the host's own packets into the delay line
DELAY_RULE_PREF = 100
UNCAPPED_MBIT = 100_000  # the rate class of a link without a cap: far above what veth carries
_CLONE_NEWNET = 0x40000000
_TUNSETIFF, _TUNSETOFFLOAD = 0x400454CA, 0x400454D0
_IFF_TUN, _IFF_NO_PI, _IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
_TUN_F_ALL = 0x01 | 0x02 | 0x04 | 0x08  # checksum, TSO4, TSO6, TSO-ECN: GSO packets whole
# classic BPF in direct-action mode: return 2 (TC_ACT_SHOT) drops, 0 (TC_ACT_OK) passes
_BPF_DROP, _BPF_PASS = "6 0 0 2", "6 0 0 0"
_BPF_DROP_ALL = f"1,{_BPF_DROP}"
_BPF_LD_RAND = "32 0 0 4294963256"  # ld #rand (SKF_AD_OFF + SKF_AD_RANDOM)
_BPF_LD_PROTOCOL = "40 0 0 4294963200"  # ldh #proto (SKF_AD_OFF + SKF_AD_PROTOCOL), host order
_SKF_NET_OFF = 0xFFF00000  # ld [SKF_NET_OFF + k]: byte k of the network header, either way
_IP_SRC, _IP_DST = 12, 16  # offsets of the addresses in an IPv4 header
_ETH_P_IP = 0x0800
_seq = itertools.count()


class HostError(RuntimeError):
    """A command that builds, shapes or runs on the hosts failed (or, from the delay line,
    a process that should have started)."""


@dataclass(frozen=True)
class Shape:
    """What a link does to the packets its host sends: added delay and uniform jitter (ms),
    loss (percent of packets) and a rate cap (Mbit/s, None: none)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None

    def __post_init__(self) -> None:
        """Refuse values a link cannot have."""
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter_ms <= delay_ms, got {self}")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss_pct must be within 0..100, got {self.loss_pct}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be above 0, got {self.rate_mbit}")


def _cmd(args: Sequence[str], *, timeout: float = 30.0) -> str:
    """Run one command; its stdout, or :class:`HostError` naming it and its stderr."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError(f"{' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise HostError(f"{' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.strip()}")
    return done.stdout


def _tc(netns: str, *args: str) -> None:
    _cmd(["tc", "-n", netns, *args])


def _ip(netns: str, *args: str) -> None:
    _cmd(["ip", "-n", netns, *args])


def _enter_netns(netns: str) -> None:
    """Move the calling thread into namespace ``netns`` (threads it starts afterwards follow)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class _EnterNetns:
    """Enters namespace ``netns`` when a spawned child unpickles it: its first argument, so the
    child is inside before the target's arguments load (the imports they need may start
    threads, and a thread started outside would stay there)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns

    def __reduce__(self) -> tuple[Callable[[str], str], tuple[str]]:
        return _entered, (self.netns,)


def _entered(netns: str) -> str:
    _enter_netns(netns)
    return netns


def _run_in_netns(netns: str, target: Callable[..., object], args: tuple[Any, ...]) -> None:
    """A spawned child's entry point, inside ``netns`` already (:class:`_EnterNetns`)."""
    target(*args)


def netns_inode(netns: str) -> int:
    """The inode that names namespace ``netns`` (equal to ``/proc/PID/task/TID/ns/net``'s for
    every thread inside it)."""
    return os.stat(os.path.join(NETNS_DIR, netns)).st_ino


def threads_outside(pid: int, netns: str) -> list[int]:
    """The threads of process ``pid`` that are not in namespace ``netns``."""
    want = netns_inode(netns)
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return [t for t in tids if os.stat(f"/proc/{pid}/task/{t}/ns/net").st_ino != want]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line]


def _delete_netns(netns: str) -> None:
    """Kill every process in ``netns`` and delete it (already gone: nothing to do)."""
    with contextlib.suppress(HostError):
        for pid in _cmd(["ip", "netns", "pids", netns]).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(HostError):
        _cmd(["ip", "netns", "delete", netns])


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces (and kill their processes) that a process which no longer runs
    made here, e.g. a test run that crashed; returns their names. Live runs' are left alone."""
    gone = []
    for name in _netns_names():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.*", name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(name)
            gone.append(name)
    return gone


def unavailable() -> str:
    """Why hosts cannot be built on this machine ("" when they can): tries each thing a host
    needs (root, ``ip``, ``tc``, a namespace, a veth pair, HTB, a BPF filter, a TUN device)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} command (iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the delay line needs a TUN device)"
    probe = f"{PREFIX}-{os.getpid()}-{next(_seq)}-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
        _ip(probe, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1")
        _tc(probe, "qdisc", "add", "dev", "p0", "root", "handle", "1:", "htb")
        _tc(probe, "qdisc", "add", "dev", "p1", "clsact")
        _tc(probe, "filter", "add", "dev", "p1", "ingress", "bpf", "da", "bytecode",
            _BPF_DROP_ALL)
    except HostError as exc:
        return f"cannot build a test host: {exc}"
    finally:
        _delete_netns(probe)
    return ""


def _free_subnet() -> ipaddress.IPv4Network:
    """The first 10.77.K.0/24 that overlaps none of the machine's own routes."""
    routes = []
    for line in _cmd(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        # "10.0.0.0/8 dev ..." or "local 127.0.0.1 dev ...": the prefix is the first number
        prefix = next((w for w in line.split()[:2] if w[0].isdigit()), None)
        if prefix is not None:
            routes.append(ipaddress.ip_network(prefix, strict=False))
    for k in range(256):
        net = ipaddress.IPv4Network(f"10.77.{k}.0/24")
        if not any(net.overlaps(r) for r in routes if r.prefixlen > 0):
            return net
    raise HostError("every 10.77.K.0/24 overlaps a route of this machine")


def _loss_rules(loss_pct: float) -> list[str]:
    """Classic-BPF instructions that drop ``loss_pct`` percent of packets (and pass the rest)."""
    if loss_pct <= 0:
        return [_BPF_PASS]
    if loss_pct >= 100:
        return [_BPF_DROP]
    threshold = round(loss_pct / 100 * 2**32)  # drop when the random word is below it
    return [_BPF_LD_RAND, f"53 1 0 {threshold}", _BPF_DROP, _BPF_PASS]


def _drop_addresses(offset: int, addresses: Sequence[str], then: list[str]) -> list[str]:
    """Instructions that drop every IPv4 packet whose address at ``offset`` of its IP header
    (:data:`_IP_SRC` or :data:`_IP_DST`) is one of ``addresses``, and run ``then`` on every
    other packet."""
    n = len(addresses)
    if n == 0:
        return then
    head = [_BPF_LD_PROTOCOL, f"21 0 {n + 2} {_ETH_P_IP}", f"32 0 0 {_SKF_NET_OFF + offset}"]
    # jeq: the last mismatch jumps over the drop; every match lands on it
    tests = [f"21 {n - 1 - i} {int(i == n - 1)} {int(ipaddress.IPv4Address(a))}"
             for i, a in enumerate(addresses)]
    return [*head, *tests, _BPF_DROP, *then]


def _program(rules: list[str]) -> str | None:
    """``rules`` as ``tc``'s bytecode argument (None for a program that passes everything)."""
    return None if rules == [_BPF_PASS] else f"{len(rules)},{','.join(rules)}"


def _delay_line(conn: Connection) -> None:
    """The delay line of one host (run in its namespace): a TUN device :data:`DELAY_IF` that
    holds every packet routed into it for the current delay (``conn`` sends ``(delay_s,
    jitter_s)``) and writes it back, in order; ends when ``conn`` closes."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", DELAY_IF.encode(),
                                            _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR))
    fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_ALL)
    with contextlib.suppress(PermissionError):  # a kernel's netem runs in softirq; come close
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    conn.send("ready")
    delay, jitter = 0.0, 0.0
    held: deque[tuple[float, bytes]] = deque()
    rng = random.Random(0)
    # poll, not select: a child may hold descriptors above select's 1024 (a parent's that were
    # not close-on-exec, such as a transfer engine's, pass through exec)
    poller = select.poll()
    for watched in (fd, conn.fileno()):
        poller.register(watched, select.POLLIN)
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready = {f for f, _ in poller.poll(None if wait is None else wait * 1000)}
        if conn.fileno() in ready:
            try:
                delay, jitter = conn.recv()
            except EOFError:
                return
        if fd in ready:
            now = time.monotonic()
            with contextlib.suppress(BlockingIOError):
                while True:
                    packet = os.read(fd, 1 << 17)
                    due = now + delay + rng.uniform(-jitter, jitter)
                    held.append((max(due, held[-1][0]) if held else due, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            with contextlib.suppress(OSError):  # a packet the stack refuses is lost
                os.write(fd, held.popleft()[1])


class Link:
    """The link between one host and the bridge (see the module docstring): :meth:`set` its
    shape, :meth:`cut` and :meth:`heal` it, at any time."""

    def __init__(self, host: Host, bridge_ns: str, port: str) -> None:
        self._host = host
        self._bridge_ns = bridge_ns
        self._port = port  # the bridge's end of the host's veth pair
        self.shape = Shape()
        self.is_cut = False  # everything dropped (cut())
        self.cut_from: tuple[str, ...] = ()  # the peers' addresses of cut(peer, ...)
        self._line: tuple[BaseProcess, Connection] | None = None
        self._routed = False  # the host's packets go through the delay line
        self._mtu_packets = False  # GSO off on the host's interfaces (while there is loss)
        self._filters: dict[str, str | None] = {"ingress": None, "egress": None}  # on the port
        _tc(host.netns, "qdisc", "add", "dev", HOST_IF, "root", "handle", "1:", "htb",
            "default", "10")
        self._set_rate(None)
        _tc(bridge_ns, "qdisc", "add", "dev", port, "clsact")

    def set(self, *, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss_pct: float = 0.0,
            rate_mbit: float | None = None) -> None:
        """Give the link this shape (everything not named goes back to none); a cut link stays
        cut until :meth:`heal`."""
        shape = Shape(delay_ms, jitter_ms, loss_pct, rate_mbit)
        if shape.rate_mbit != self.shape.rate_mbit:
            self._set_rate(shape.rate_mbit)
        if (shape.loss_pct > 0) != self._mtu_packets:
            self._set_mtu_packets(shape.loss_pct > 0)
        if (shape.delay_ms, shape.jitter_ms) != (self.shape.delay_ms, self.shape.jitter_ms):
            self._set_delay(shape.delay_ms / 1000, shape.jitter_ms / 1000)
        self.shape = shape
        self._set_filters()

    def cut(self, *peers: Host) -> None:
        """Drop every packet between the host and the bridge, both ways, from now on; with
        ``peers``, only the IPv4 packets between the host and those peers (added to the peers
        cut before)."""
        if peers:
            self.cut_from = tuple(dict.fromkeys([*self.cut_from, *(p.address for p in peers)]))
        else:
            self.is_cut = True
        self._set_filters()

    def heal(self) -> None:
        """End every cut: the link carries packets again, with its shape."""
        self.is_cut, self.cut_from = False, ()
        self._set_filters()

    def dropped(self) -> int:
        """Packets the link's filters dropped so far (loss and cuts, both ways)."""
        out = _cmd(["tc", "-s", "-n", self._bridge_ns, "qdisc", "show", "dev", self._port])
        m = re.search(r"qdisc clsact .*?dropped (\d+)", out, re.S)
        return int(m.group(1)) if m else 0

    def close(self) -> None:
        """Stop the delay line (the namespace's deletion takes the rest)."""
        if self._line is not None:
            proc, conn = self._line
            conn.close()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            self._line = None

    def _set_rate(self, rate_mbit: float | None) -> None:
        rate = UNCAPPED_MBIT if rate_mbit is None else rate_mbit
        # a burst of 2 ms at the rate (at least 64 KiB) lets HTB keep up with the cap
        burst = max(64 * 1024, int(rate * 1e6 / 8 * 0.002))
        _tc(self._host.netns, "class", "replace", "dev", HOST_IF, "parent", "1:", "classid",
            "1:10", "htb", "rate", f"{rate:g}mbit", "burst", str(burst), "cburst", str(burst),
            "quantum", "60000")

    def _set_mtu_packets(self, on: bool) -> None:
        """Make the host send one MTU-sized packet per GSO segment (``on``) or whole TSO
        segments again, on its interface and its delay line, open connections included."""
        self._mtu_packets = on
        for dev in [HOST_IF] + ([DELAY_IF] if self._line is not None else []):
            _ip(self._host.netns, "link", "set", "dev", dev, "gso_max_segs",
                "1" if on else "65535")
        _ip(self._host.netns, "route", "flush", "cache")

    def _set_filters(self) -> None:
        """The port's filters for the cuts and the loss now: packets from the host (ingress)
        lose what the loss takes, packets to the host (egress) nothing."""
        if self.is_cut:
            self._set_filter("ingress", _BPF_DROP_ALL)
            self._set_filter("egress", _BPF_DROP_ALL)
            return
        self._set_filter("ingress", _program(_drop_addresses(
            _IP_DST, self.cut_from, _loss_rules(self.shape.loss_pct))))
        self._set_filter("egress", _program(_drop_addresses(_IP_SRC, self.cut_from,
                                                            [_BPF_PASS])))

    def _set_filter(self, direction: str, program: str | None) -> None:
        """Make ``program`` the port's only ``direction`` filter (None: no filter)."""
        if program == self._filters[direction]:
            return
        if program is None:
            _tc(self._bridge_ns, "filter", "del", "dev", self._port, direction, "pref", "1")
        else:
            _tc(self._bridge_ns, "filter", "replace", "dev", self._port, direction, "pref",
                "1", "handle", "1", "bpf", "da", "bytecode", program)
        self._filters[direction] = program

    def _set_delay(self, delay_s: float, jitter_s: float) -> None:
        host = self._host
        if delay_s > 0 and self._line is None:
            self._line = self._start_line()
        if self._line is not None:
            self._line[1].send((delay_s, jitter_s))
        if (delay_s > 0) != self._routed:
            verb = "add" if delay_s > 0 else "del"
            _ip(host.netns, "rule", verb, "pref", str(DELAY_RULE_PREF), "iif", "lo", "lookup",
                str(DELAY_TABLE))
            self._routed = delay_s > 0

    def _start_line(self) -> tuple[BaseProcess, Connection]:
        """Start the host's delay line and route into it: the host's own packets to the subnet
        (rule ``iif lo``) go into the TUN device; what comes back out of it is forwarded."""
        host = self._host
        conn, child = mp.get_context("spawn").Pipe()
        proc = host.spawn(_delay_line, child)
        child.close()
        try:
            conn.recv()
        except EOFError as exc:
            raise HostError(f"the delay line of {host.netns} ended (its error is on "
                            "stderr)") from exc
        host.run(["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                  f"net.ipv4.conf.{DELAY_IF}.rp_filter=0",
                  f"net.ipv4.conf.{DELAY_IF}.accept_local=1"])
        _ip(host.netns, "link", "set", DELAY_IF, "up", "txqueuelen", "10000", "gso_max_segs",
            "1" if self._mtu_packets else "65535")
        _ip(host.netns, "route", "add", str(host.subnet), "dev", DELAY_IF, "src", host.address,
            "table", str(DELAY_TABLE))
        return proc, conn


class Host:
    """One host: a network namespace with an address on the bridge and its :class:`Link`."""

    def __init__(self, netns: str, address: str, subnet: ipaddress.IPv4Network) -> None:
        self.netns = netns
        self.address = address
        self.subnet = subnet
        self._procs: list[subprocess.Popen[bytes] | BaseProcess] = []
        self.link: Link  # set by Hosts once the bridge's port exists

    def run(self, args: Sequence[str], *, timeout: float = 30.0) -> str:
        """Run ``args`` in the host's namespace to the end; its stdout (a failure raises)."""
        return _cmd(["ip", "netns", "exec", self.netns, *args], timeout=timeout)

    def popen(self, args: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``args`` in the host's namespace (``env``: its whole environment; other
        keywords go to :class:`subprocess.Popen`); killed by :meth:`Hosts.close` at the end."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *args],
                                env=dict(env) if env is not None else None, **kwargs)
        self._procs.append(proc)
        return proc

    def spawn(self, target: Callable[..., object], *args: Any) -> BaseProcess:
        """Start ``target(*args)`` in a ``spawn`` child that enters the host's namespace first
        (so its sockets and every thread it starts live there); killed by :meth:`Hosts.close`
        at the end."""
        proc = mp.get_context("spawn").Process(
            target=_run_in_netns, args=(_EnterNetns(self.netns), target, args), daemon=True)
        proc.start()
        self._procs.append(proc)
        return proc

    def reap(self) -> None:
        """Kill and wait for every process started on this host."""
        for proc in self._procs:
            if isinstance(proc, subprocess.Popen):
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            else:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        self._procs.clear()


class Hosts:
    """``n`` hosts on one bridge (see the module docstring); use as a context manager, or call
    :meth:`close`, which always deletes what was made, also after a failure halfway."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one host, got {n}")
        stem = f"{PREFIX}-{os.getpid()}-{next(_seq)}"
        self.bridge_ns = f"{stem}-br"
        self.hosts: list[Host] = []
        self._made: list[str] = []  # namespaces to delete, in order of making
        self.subnet = _free_subnet()
        try:
            self._add_netns(self.bridge_ns)
            _ip(self.bridge_ns, "link", "add", BRIDGE, "type", "bridge")
            _ip(self.bridge_ns, "link", "set", BRIDGE, "up")
            for i in range(n):
                self.hosts.append(self._add_host(stem, i))
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _cmd(["ip", "netns", "add", name])
        self._made.append(name)

    def _add_host(self, stem: str, i: int) -> Host:
        netns, port = f"{stem}-h{i}", f"h{i}"
        self._add_netns(netns)
        host = Host(netns, str(self.subnet[i + 1]), self.subnet)
        host.run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                  "net.ipv6.conf.default.disable_ipv6=1"])  # IPv4 only: no stray packets
        _cmd(["ip", "link", "add", HOST_IF, "netns", netns, "type", "veth", "peer", "name",
              port, "netns", self.bridge_ns])
        _ip(self.bridge_ns, "link", "set", port, "master", BRIDGE, "up")
        _ip(netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", HOST_IF)
        _ip(netns, "link", "set", HOST_IF, "up")
        _ip(netns, "link", "set", "lo", "up")
        host.link = Link(host, self.bridge_ns, port)
        return host

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the delay lines, kill every process in the namespaces, delete them."""
        for host in self.hosts:
            host.link.close()
            host.reap()
        for name in reversed(self._made):
            _delete_netns(name)
        self._made.clear()
