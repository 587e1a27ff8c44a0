"""Fixtures of the network tests: hosts in network namespaces (:mod:`tests.netns.hosts`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from bench.netns_hosts import Hosts
from tests.netns.hosts import netns_skip_reason


@pytest.fixture(scope="session")
def netns_ready() -> None:
    """Skip unless hosts can be built here; the first use deletes the namespaces that runs
    which no longer run left behind."""
    reason = netns_skip_reason()
    if reason:
        pytest.skip(f"no test hosts on this machine: {reason}")


@pytest.fixture
def make_hosts(netns_ready: None) -> Iterator[Callable[[int], Hosts]]:
    """``make_hosts(n)`` builds ``n`` hosts on one bridge; every set made is torn down after
    the test, whether it passed or not."""
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        made.append(Hosts(n))
        return made[-1]

    yield make
    for hosts in made:
        hosts.close()
