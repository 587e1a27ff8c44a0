"""The router's settings, parsed once from the command line and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from router.recovery import RecoveryConfig
from serving.hosts import check_host
from serving.keepalive import Keepalive

MODE_DISAGGREGATED = "disaggregated"
MODE_COLOCATED = "colocated"
LEAST_LOADED = "least-loaded"
CACHE_AWARE = "cache-aware"


@dataclass(frozen=True)
class VideoLimits:
    """What one request may send as video; more is refused with INVALID_ARGUMENT."""

    max_videos: int = 4  # videos per request
    max_frames: int = 256  # frames per video
    max_patch_bytes: int = 128 << 20  # float32 patch bytes of one video (frames or patches)

    def __post_init__(self) -> None:
        if self.max_videos < 0 or self.max_frames < 1 or self.max_patch_bytes < 1:
            raise ValueError("video limits: max_videos must be >= 0 (0: no videos), "
                             "max_frames and max_patch_bytes >= 1")


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks a worker (:mod:`router.policy`).

    ``cache-aware``: the worker with the longest prefix of the prompt in its cache (as the
    router's tree of it says), unless the healthy workers' loads (requests) differ by more than
    ``balance_abs_threshold`` and the largest exceeds ``balance_rel_threshold`` times the
    smallest; then, or when nothing matches, the least loaded. ``kv_events``: the trees follow
    the workers' ``SubscribeKvEvents`` streams instead of the prompts this router sent.
    """

    policy: str = LEAST_LOADED
    balance_abs_threshold: int = 32  # requests
    balance_rel_threshold: float = 1.5
    max_tree_blocks: int = 1 << 16  # blocks of each worker's tree in approximate mode
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.policy not in (LEAST_LOADED, CACHE_AWARE):
            raise ValueError(f"--policy must be {LEAST_LOADED} or {CACHE_AWARE}, "
                             f"got {self.policy!r}")
        if self.kv_events and self.policy != CACHE_AWARE:
            raise ValueError(f"--kv-events needs --policy {CACHE_AWARE}")
        if self.balance_abs_threshold < 0 or not self.balance_rel_threshold >= 1.0:  # nan too
            raise ValueError("--balance-abs-threshold must be >= 0 and "
                             "--balance-rel-threshold >= 1")
        if self.max_tree_blocks < 1:
            raise ValueError("--max-tree-blocks must be at least 1")


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
    video_limits: VideoLimits = VideoLimits()
    load_refresh_s: float = 1.0  # period of GetLoad polls on every worker
    worker_timeout_s: float = 5.0  # deadline of the router's unary calls to workers
    max_running: int = 1024  # live client streams; more are refused with RESOURCE_EXHAUSTED
    internal_token: str | None = None  # sent to every worker (their --internal-token-file)
    http_port: int | None = None  # OpenAI-compatible HTTP door (router.http_door); None = off
    served_model_name: str | None = None  # the model id of the HTTP door; default: dir name
    recovery: RecoveryConfig = RecoveryConfig()  # what failed workers lead to (router.recovery)
    routing: RoutingConfig = RoutingConfig()  # how workers are picked (router.policy)
    keepalive: Keepalive = Keepalive()  # of its worker channels and its server (serving.keepalive)

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either --colocated or --prefill and --decode, not both")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("give --colocated HOST:PORT, or both --prefill and --decode")
        if self.max_new_tokens_default < 1:
            raise ValueError("--max-new-tokens-default must be at least 1")
        if self.local_prefill_threshold < 0:
            raise ValueError("--local-prefill-threshold must be >= 0")
        if self.max_running < 1:
            raise ValueError("--max-running must be at least 1")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError("--http-port must be in [0, 65535]")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.name

    @property
    def mode(self) -> str:
        return MODE_COLOCATED if self.colocated else MODE_DISAGGREGATED


DNS_PREFIX = "dns:"


def parse_addresses(text: str | None) -> tuple[str, ...]:
    """``"h1:p1,dns:name:p2"`` -> ``("h1:p1", "dns:name:p2")``; raises ValueError on a malformed
    entry.

    An entry is ``HOST:PORT`` (one worker) or ``dns:NAME:PORT`` (every A record of ``NAME``,
    e.g. a Kubernetes headless service, each at ``PORT``; the router re-resolves it
    periodically, see :class:`router.workers.WorkerPool`).
    """
    if not text:
        return ()
    out = []
    for item in text.split(","):
        item = item.strip()
        if split_dns(item) is not None:  # validates a dns:NAME:PORT entry
            out.append(item)
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not _valid_port(port):
            raise ValueError(f"worker address must be HOST:PORT or dns:NAME:PORT, got {item!r}")
        if ":" in host and not host.startswith("["):
            raise ValueError(f"worker address {item!r}: an IPv6 host goes in brackets, "
                             "[ADDRESS]:PORT")
        _check_host(host, item)
        out.append(item)
    return tuple(out)


def split_dns(address: str) -> tuple[str, int] | None:
    """``"dns:NAME:PORT"`` -> ``(NAME, PORT)``; None for a plain ``HOST:PORT`` (``dns:50051``
    included: a host named ``dns``).

    Raises ValueError when the entry starts with ``dns:`` but is not ``dns:NAME:PORT``.
    """
    if not address.startswith(DNS_PREFIX) or ":" not in address[len(DNS_PREFIX):]:
        return None
    name, sep, port = address[len(DNS_PREFIX):].rpartition(":")
    if not sep or not name or ":" in name or not _valid_port(port):
        raise ValueError(f"DNS worker address must be dns:NAME:PORT, got {address!r}")
    _check_host(name, address)
    return name, int(port)


def _check_host(host: str, entry: str) -> None:
    try:
        check_host(host)
    except ValueError as exc:
        raise ValueError(f"worker address {entry!r}: {exc}") from None


def _valid_port(port: str) -> bool:
    return port.isdigit() and 0 < int(port) < 65536
