"""The address a node bound to every interface (``--host 0.0.0.0``, no ``--advertise-host``)
advertises, worked out inside a test host: the host's own address, which the other hosts reach.
Before, it was the machine's host name's address, 127.0.0.1 in these hosts (and on Debian
127.0.1.1): a prefill started so on host 1 reported the bootstrap endpoint ``127.0.0.1:PORT``
to the router, and its transfer engine's session too. With a second address the host must be
told which one: the node refuses to start, naming both and ``--advertise-host``.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from bench.netns_hosts import Host, Hosts


def _advertised(conn: Any) -> None:
    """Inside a host: what a wildcard-bound node advertises, or the error it starts with."""
    import argparse

    from cli.engine_args import advertise_host
    from engine.errors import InvalidRequestError

    try:
        conn.send(advertise_host(argparse.Namespace(host="0.0.0.0", advertise_host=None)))
    except InvalidRequestError as exc:
        conn.send(f"error: {exc}")


def advertised_on(host: Host) -> str:
    """What :func:`_advertised` answers in a process inside ``host``."""
    conn, child = mp.get_context("spawn").Pipe()
    proc = host.spawn(_advertised, child)
    child.close()
    try:
        assert conn.poll(60), f"no answer from {host.netns}"
        return str(conn.recv())
    finally:
        proc.join(10)


def test_a_wildcard_node_advertises_its_hosts_address(
        make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    assert advertised_on(hosts[1]) == hosts[1].address
    second = str(hosts.subnet[200])
    hosts[1].run(["ip", "addr", "add", f"{second}/{hosts.subnet.prefixlen}", "dev", "eth0"])
    assert advertised_on(hosts[1]) == (
        f"error: --host 0.0.0.0 binds every interface, and other machines need the one address "
        f"of this one they reach it on: it has several ({hosts[1].address}, {second}); give it "
        "with --advertise-host")
    assert advertised_on(hosts[0]) == hosts[0].address  # the other host: one address still
