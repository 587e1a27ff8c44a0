"""Malformed hosts in flags, refused before anything starts: one ``error:`` line naming the
flag or the entry, exit status 2. Before, ``decode --host "bad host"`` started its transfer
engine and then failed on gRPC's bind (exit status 1), and a router given a malformed worker
address served and logged UNAVAILABLE for it every few seconds."""

from __future__ import annotations

import argparse
import socket

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


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_advertises_this_machine(wildcard: str) -> None:
    from cli.engine_args import advertise_host

    here = socket.gethostbyname(socket.gethostname())
    assert advertise_host(argparse.Namespace(host=wildcard, advertise_host=None)) == here
    assert advertise_host(argparse.Namespace(host="10.1.2.3", advertise_host=None)) == "10.1.2.3"
    assert advertise_host(argparse.Namespace(host=wildcard, advertise_host="node-1")) == "node-1"
