"""Host names and IP addresses as flags and worker lists give them, checked when they are parsed.

A malformed host is refused with what is wrong before anything starts. Before, ``--host "bad
host"`` started the transfer engine and then failed on gRPC's "Failed to bind to address"
(exit status 1), and a router given ``--prefill "bad host:1"`` served and logged UNAVAILABLE
every few seconds. Only the form is checked: whether a name resolves depends on where it is
resolved (a Kubernetes service name resolves in its cluster only).
"""

from __future__ import annotations

import ipaddress
import re

MAX_NAME = 253  # characters of a DNS name
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # RFC 1123, "_" allowed


def check_host(text: str) -> str:
    """``text`` if it is a host name (dot-separated labels of letters, digits, ``-`` and
    ``_``, at most 253 characters, a trailing dot allowed), an IPv4 address or an IPv6 address
    (bare or in brackets, a ``%zone`` allowed); ``ValueError`` saying why otherwise."""
    if not text:
        raise ValueError("a host must not be empty")
    bracketed = text.startswith("[") and text.endswith("]")
    inner = text[1:-1] if bracketed else text
    if bracketed or ":" in inner:
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError(f"{text!r} is not an IPv6 address") from None
        return text
    labels = inner[:-1].split(".") if inner.endswith(".") else inner.split(".")
    if len(inner) > MAX_NAME or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{text!r} is not a host name or an IP address (labels of letters, "
                         "digits, '-' and '_', joined by dots)")
    return text


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, or ``[ADDRESS]:PORT`` for a bare IPv6 address (the form gRPC targets and
    the router's worker lists take)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
