"""The form of a host name or IP address (``serving.hosts.check_host``), which the servers'
``--host``/``--advertise-host`` flags and the router's worker lists check when parsed."""

from __future__ import annotations

import pytest

from serving.hosts import check_host, host_port

GOOD = ["127.0.0.1", "0.0.0.0", "localhost", "pdserve-prefill-0.pdserve-prefill.default.svc",
        "node_1", "example.com.", "::", "::1", "[::1]", "fe80::1%eth0", "a" * 63]
BAD = [("", "must not be empty"), ("bad host", "not a host name"), ("-a", "not a host name"),
       ("a-", "not a host name"), ("a..b", "not a host name"), ("a" * 64, "not a host name"),
       (".".join(["a" * 60] * 5), "not a host name"), ("host:name!", "not an IPv6 address"),
       ("[1.2.3.4]", "not an IPv6 address"), ("[::1", "not an IPv6 address"),
       ("::g", "not an IPv6 address"), ("a/b", "not a host name")]


@pytest.mark.parametrize("text", GOOD)
def test_host_names_and_addresses_pass_unchanged(text: str) -> None:
    assert check_host(text) == text


@pytest.mark.parametrize(("text", "says"), BAD, ids=[repr(t) for t, _ in BAD])
def test_malformed_hosts_are_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_host(text)


def test_host_port_brackets_bare_ipv6_addresses_only() -> None:
    assert host_port("10.0.0.1", 7) == "10.0.0.1:7"
    assert host_port("node-1.cluster", 7) == "node-1.cluster:7"
    assert host_port("fe80::1", 7) == "[fe80::1]:7"
    assert host_port("[::1]", 7) == "[::1]:7"
