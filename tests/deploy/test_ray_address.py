"""The launcher's check that a ``HOST:PORT`` Ray address takes TCP connections before
``ray.init`` (which retries a dead one for minutes); other address forms are Ray's to judge."""

from __future__ import annotations

import socket

import pytest

from deploy.ray_launcher import _check_listening


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_listening_address_passes(family: socket.AddressFamily, host: str) -> None:
    try:
        server = socket.socket(family)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    with server:
        server.listen()
        port = server.getsockname()[1]
        _check_listening(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


def test_nothing_listening_is_a_connection_error() -> None:
    with socket.socket() as probe:  # a port just freed: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _check_listening(f"127.0.0.1:{port}", timeout_s=2.0)


@pytest.mark.parametrize("address", ["auto", "local", "ray://127.0.0.1:1", "head-node"])
def test_other_forms_are_left_to_ray(address: str) -> None:
    _check_listening(address)  # no probe, no error
