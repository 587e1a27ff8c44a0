"""The router's settings, parsed once from the command line and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODE_DISAGGREGATED = "disaggregated"
MODE_COLOCATED = "colocated"


@dataclass(frozen=True)
class RouterConfig:
    """How one router process serves.

    Invariant: ``mode == "colocated"`` iff ``colocated`` is non-empty; in disaggregated mode both
    ``prefill`` and ``decode`` are non-empty and ``colocated`` is empty.
    """

    model_dir: Path
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    max_new_tokens_default: int = 128
    local_prefill_threshold: int = 0  # prompts shorter than this prefill on D; 0 = off
    max_images: int = 16
    load_refresh_s: float = 1.0  # period of GetLoad polls on every worker
    worker_timeout_s: float = 5.0  # deadline of the router's unary calls to workers

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either --colocated or --prefill and --decode, not both")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("give --colocated HOST:PORT, or both --prefill and --decode")
        if self.max_new_tokens_default < 1:
            raise ValueError("--max-new-tokens-default must be at least 1")
        if self.local_prefill_threshold < 0:
            raise ValueError("--local-prefill-threshold must be >= 0")

    @property
    def mode(self) -> str:
        return MODE_COLOCATED if self.colocated else MODE_DISAGGREGATED


def parse_addresses(text: str | None) -> tuple[str, ...]:
    """``"h1:p1,h2:p2"`` -> ``("h1:p1", "h2:p2")``; raises ValueError on a malformed entry."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        item = item.strip()
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"worker address must be HOST:PORT, got {item!r}")
        out.append(item)
    return tuple(out)
