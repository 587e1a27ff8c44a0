"""Malformed hosts in flags, refused before anything starts: one ``error:`` line naming the
flag or the entry, exit status 2. Before, ``decode --host "bad host"`` started its transfer
engine and then failed on gRPC's bind (exit status 1), and a router given a malformed worker
address served and logged UNAVAILABLE for it every few seconds. And what a worker bound to
every interface advertises when not told: an address of its machine that other machines reach
(before: its host name's address, loopback on many machines)."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest

from tests.cli.test_numeric_flags import refused_in_one_line

CASES = [
    (["decode", "--host", "bad host"], "argument --host: 'bad host' is not a host name"),
    (["prefill", "--host", ""], "argument --host: a host must not be empty"),
    (["router", "--host", "[::1"], "argument --host: '[::1' is not an IPv6 address"),
    (["prefill", "--advertise-host", ""], "argument --advertise-host: a host must not be empty"),
    (["decode", "--advertise-host", "a..b"], "argument --advertise-host: 'a..b' is not a host"),
    (["router", "--prefill", "bad host:1", "--decode", "127.0.0.1:2"],
     "worker address 'bad host:1': 'bad host' is not a host name"),
    (["router", "--prefill", "127.0.0.1:1", "--decode", "::1:5"],
     "worker address '::1:5': an IPv6 host goes in brackets, [ADDRESS]:PORT"),
    (["router", "--colocated", "dns:bad_name!:5"], "worker address 'dns:bad_name!:5': "),
]


@pytest.mark.timeout(60)  # a check that regressed would start the server here
@pytest.mark.parametrize(("argv", "says"), CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_malformed_hosts_are_one_line_naming_the_flag(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused_in_one_line(argv, capsys)
    assert says in err, err


def test_bracketed_ipv6_worker_addresses_are_accepted() -> None:
    from router.config import parse_addresses

    assert parse_addresses("[::1]:50051,dns:svc.ns:7") == ("[::1]:50051", "dns:svc.ns:7")


def fib_trie(*addresses: str) -> str:
    """A ``/proc/net/fib_trie`` of a machine with loopback and ``addresses`` (each on a /24 of
    its own: the leaf of its network, its own, and its broadcast's)."""
    lines = ["Local:", "  +-- 0.0.0.0/0 3 0 5", "     +-- 127.0.0.0/8 2 0 2",
             "           |-- 127.0.0.0", "              /8 host LOCAL",
             "           |-- 127.0.0.1", "              /32 host LOCAL"]
    for address in addresses:
        net = address.rsplit(".", 1)[0]
        lines += [f"     +-- {net}.0/24 2 0 2", f"           |-- {net}.0",
                  "              /24 link UNICAST", f"           |-- {address}",
                  "              /32 host LOCAL", f"        |-- {net}.255",
                  "           /32 link BROADCAST"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("named", "own", "advertised"), [
    ("127.0.1.1", ["192.0.2.7"], "192.0.2.7"),  # Debian's host name: loopback, not advertised
    ("127.0.0.1", ["10.77.0.2"], "10.77.0.2"),  # a network namespace of the test hosts
    ("10.0.0.5", ["172.17.0.1", "10.0.0.5"], "10.0.0.5"),  # a host name of its own: it wins
    ("203.0.113.9", ["10.0.0.5"], "10.0.0.5"),  # a name of another machine (stale /etc/hosts)
    (None, ["10.0.0.5"], "10.0.0.5"),  # a host name that does not resolve
], ids=["debian", "netns", "named", "stale", "unresolved"])
@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_advertises_the_address_other_machines_reach(
        wildcard: str, named: str | None, own: list[str], advertised: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cli import engine_args
    from cli.engine_args import advertise_host

    (tmp_path / "fib_trie").write_text(fib_trie(*own))
    monkeypatch.setattr(engine_args, "FIB_TRIE", str(tmp_path / "fib_trie"))
    monkeypatch.setattr(socket, "gethostname", lambda: "node")

    def resolve(name: str) -> str:
        assert name == "node"
        if named is None:
            raise socket.gaierror("no such name")
        return named

    monkeypatch.setattr(socket, "gethostbyname", resolve)
    assert advertise_host(argparse.Namespace(host=wildcard, advertise_host=None)) == advertised
    assert advertise_host(argparse.Namespace(host="10.1.2.3", advertise_host=None)) == "10.1.2.3"
    assert advertise_host(argparse.Namespace(host=wildcard, advertise_host="node-1")) == "node-1"


@pytest.mark.parametrize("own", [["172.17.0.1", "10.0.0.5"], []], ids=["several", "none"])
def test_a_wildcard_host_on_a_machine_without_one_address_must_be_told(
        own: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose host name resolves to loopback, with several addresses (or none):
    which one other machines reach is not for the node to guess."""
    from cli import engine_args
    from cli.engine_args import advertise_host
    from engine.errors import InvalidRequestError

    (tmp_path / "fib_trie").write_text(fib_trie(*own))
    monkeypatch.setattr(engine_args, "FIB_TRIE", str(tmp_path / "fib_trie"))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    has = "several (10.0.0.5, 172.17.0.1)" if own else "none but loopback"
    with pytest.raises(InvalidRequestError, match=re.escape(
            f"--host 0.0.0.0 binds every interface, and other machines need the one address of "
            f"this one they reach it on: it has {has}; give it with --advertise-host")):
        advertise_host(argparse.Namespace(host="0.0.0.0", advertise_host=None))
