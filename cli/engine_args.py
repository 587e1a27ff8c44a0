"""Command-line flags shared by every command that builds an engine or serves gRPC."""

from __future__ import annotations

import argparse
import ipaddress
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from cli.arg_types import (
    float_in,
    host,
    non_negative,
    non_negative_float,
    port,
    positive,
    positive_float,
)
from engine.config import KEEP_ROWS, VERIFY_STATES
from serving import keepalive as ka
from serving.admission import DEFAULT_MAX_WAITING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from serving.auth import ServerSecurity
    from transfer.bootstrap.handshake import BootstrapConfig
    from transfer.faults import FaultConfig

WORKER_SERVICES = ("pdserve.v1.PrefillWorker", "pdserve.v1.DecodeWorker", "pdserve.v1.Admin",
                   "pdserve.v1.PipelineStage")


DEVICE_HELP = ("auto | cpu | cuda | npu (cuda:N / npu:N for one device); auto takes CUDA if "
               "torch sees a GPU, else an Ascend NPU if torch_npu sees one, else the CPU")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # engine.device.DTYPE_CHOICES


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype``, ``--no-graphs`` and ``--cuda-graph-sizes`` (also on ``pdserve
    launch``, for workers)."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights and KV cache; auto: bfloat16 on cuda/npu, float32 on cpu")
    p.add_argument("--no-graphs", action="store_true",
                   help="CUDA: run decode steps eagerly instead of through captured CUDA graphs")
    p.add_argument("--cuda-graph-sizes", type=positive, nargs="+", default=None, metavar="N",
                   help="CUDA: the padded batch sizes whose decode (and EAGLE verify and draft "
                        "extend) graphs are captured at start-up; --max-num-seqs is always "
                        "one (default: 1 2 4 8 16 24 32 48 ... up to --max-num-seqs)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory, or builtin, builtin:qwen2-vl, builtin:hybrid "
                   "(the shipped tiny models; default: builtin)")
    add_device_args(p)
    p.add_argument("--page-size", type=positive, default=16)
    p.add_argument("--num-pages", type=positive, default=None,
                   help="KV pool pages (default: as many as --kv-budget-mb buys)")
    p.add_argument("--kv-budget-mb", type=positive, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive, default=512,
                   help="token budget per step (also the prefill chunk size)")
    p.add_argument("--max-num-seqs", type=positive, default=64)
    p.add_argument("--state-slots", type=positive, default=None, metavar="N",
                   help="a hybrid model's linear-attention state slots, one per request that "
                        "runs or (on a decode node) is in transfer (default: --max-num-seqs; "
                        "twice that on a decode node); ignored for other models")
    p.add_argument("--state-checkpoints", type=non_negative, default=16, metavar="N",
                   help="a hybrid model's prefix cache: keep up to N linear-attention state "
                        "checkpoints (each one state slot's bytes, state_checkpoint_bytes in "
                        "the stats), evicted least recently used; a KV hit reaches only as far "
                        "as the last checkpoint of its prefix (0: no hybrid hits on this "
                        "node's own prefills)")
    p.add_argument("--state-checkpoint-interval", type=positive, default=512, metavar="TOKENS",
                   help="a hybrid model's prompts keep a state checkpoint every TOKENS tokens "
                        "(a multiple of --page-size; prefill chunks end there)")
    p.add_argument("--verify-states", choices=VERIFY_STATES, default=KEEP_ROWS,
                   help="a hybrid model's speculative verify (with --draft): keep each "
                        "linear-attention layer's recurrent state after every window row "
                        "('rows', default: the faster on a CPU) or only the rows' inputs, "
                        "stepping the accepted rows again once their count is known ('replay': "
                        "about 1/60 of the memory, some 1.2-1.6x the time); the kept states are "
                        "the same bits; ignored for other models")
    p.add_argument("--max-model-len", type=positive, default=None)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full instead of reusing the KV of full pages "
                        "of earlier prompts with the same prefix (tokens and images); on a "
                        "decode node also: ask the prefill for every page of the prompt")


def add_tp_args(p: argparse.ArgumentParser) -> None:
    """``--tp-size`` (commands whose engine may be split over processes)."""
    p.add_argument("--tp-size", type=positive, default=1, metavar="N",
                   help="tensor parallelism: split the decoder over N processes of this machine "
                        "(one per rank: gloo on cpu, NCCL on cuda:i..i+N-1, HCCL on npu); N must "
                        "divide the attention heads; not with --draft")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of the flags, with ``--device`` and ``--dtype`` resolved on this
    machine (``auto`` becomes a concrete name, so every consumer of the config, the P/D model
    identity included, sees what really runs); a device this machine cannot run raises
    ``DeviceError`` (one ``error:`` line, exit 2)."""
    from engine.config import EngineConfig
    from engine.device import dtype_name, resolve_device, resolve_dtype  # torch: engine commands

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    return EngineConfig(
        page_size=args.page_size, num_pages=args.num_pages, kv_budget_bytes=args.kv_budget_mb << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, dtype=dtype_name(dtype), device=str(device),
        graphs=not args.no_graphs, enable_prefix_cache=not args.no_prefix_cache,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
        tp_size=getattr(args, "tp_size", 1),  # only commands with add_tp_args have the flag
        state_slots=args.state_slots, state_checkpoints=args.state_checkpoints,
        state_checkpoint_interval=args.state_checkpoint_interval,
        verify_states=args.verify_states,
    )


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 to serve other machines)")
    p.add_argument("--port", type=port, default=default_port, help="0 picks a free port")
    p.add_argument("--metrics-port", type=port, default=None, metavar="N",
                   help="serve Prometheus /metrics over HTTP on this port of --host (0 picks a "
                        "free one; printed as METRICS <port>); default: off")
    p.add_argument("--internal-token-file", default=None, metavar="FILE",
                   help="shared secret of the cluster's internal calls: workers require it "
                        "(metadata x-pdserve-internal-token) on PrefillWorker, DecodeWorker, "
                        "PipelineStage and Admin calls, and a prefill's KV bootstrap endpoint "
                        "requires it in a decode's registration; the router sends it to every "
                        "worker")
    p.add_argument("--keepalive-time-s", type=float_in(ka.MIN_TIME_S, ka.MAX_S),
                   default=ka.TIME_S, metavar="S",
                   help="gRPC keepalive: ping the peer of every connection this node has to "
                        "another node (and of every one its server accepts) after S seconds "
                        f"(default {ka.TIME_S:g}; at least {ka.MIN_TIME_S:g})")
    p.add_argument("--keepalive-timeout-s", type=float_in(ka.MIN_TIMEOUT_S, ka.MAX_S),
                   default=ka.TIMEOUT_S, metavar="S",
                   help="gRPC keepalive: close a connection whose ping is not answered within "
                        "S seconds (its calls end UNAVAILABLE, or are cancelled on the server: "
                        f"a partition is found within time + timeout; default {ka.TIMEOUT_S:g})")


def keepalive(args: argparse.Namespace) -> ka.Keepalive:
    """The gRPC keepalive of ``--keepalive-time-s`` and ``--keepalive-timeout-s``."""
    return ka.Keepalive(args.keepalive_time_s, args.keepalive_timeout_s)


def internal_token(args: argparse.Namespace) -> str | None:
    """The secret of ``--internal-token-file`` (None without it); ValueError if empty."""
    from serving.auth import read_secret

    return read_secret(args.internal_token_file)


def worker_security(args: argparse.Namespace) -> ServerSecurity:
    """A worker's server protection: the internal token on its router-facing services."""
    from serving.auth import ServerSecurity, internal

    secret = internal_token(args)
    return ServerSecurity(requirements=(internal(secret, WORKER_SERVICES),) if secret else ())


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Admission bound and handshake timeouts of a prefill or decode worker."""
    p.add_argument("--max-waiting", type=positive, default=DEFAULT_MAX_WAITING, metavar="N",
                   help="refuse new rooms with RESOURCE_EXHAUSTED (and a retry-after-ms hint) "
                        "while N already wait here (prefill: gated + queued; decode: waiting "
                        "for pages + queued)")
    p.add_argument("--bootstrap-timeout-s", type=positive_float, default=300.0,
                   help="a room whose destination does not arrive in time fails")
    p.add_argument("--waiting-timeout-s", type=positive_float, default=300.0,
                   help="decode: a room whose KV does not arrive in time after its "
                        "destination was sent fails")
    p.add_argument("--heartbeat-interval-s", type=positive_float, default=5.0,
                   help="P/D heartbeat period; a peer silent for 2 periods is dead")
    p.add_argument("--quarantine-s", type=non_negative_float, default=30.0,
                   help="decode: hold a failed room's pages this long when its prefill died "
                        "without saying it stopped writing (and, when the prefill went silent, "
                        "until it was silent for longer than the decode's transfer connections "
                        "take to drop a silent peer: the peer timeout rounded up to whole "
                        "seconds, plus one keepalive probe and one heartbeat interval)")
    add_fault_args(p)


def bootstrap_config(args: argparse.Namespace) -> BootstrapConfig:
    from transfer.bootstrap.handshake import BootstrapConfig

    return BootstrapConfig(
        bootstrap_timeout_s=args.bootstrap_timeout_s, waiting_timeout_s=args.waiting_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval_s, quarantine_s=args.quarantine_s,
        secret=internal_token(args), faults=fault_config(args))


# ---- fault injection (tests and drills; off by default) ------------------------------------


def add_fault_args(p: argparse.ArgumentParser) -> None:
    """``--fault-*`` flags of a prefill or decode worker; each defaults to its ``PDSERVE_FAULT_*``
    environment variable (see :mod:`transfer.faults`)."""
    from transfer.faults import FaultConfig

    env = FaultConfig.from_env()
    g = p.add_argument_group("fault injection (tests only; env PDSERVE_FAULT_<NAME>)")
    g.add_argument("--fault-transfer-fail-p", type=float, default=env.transfer_fail_p,
                   metavar="P", help="fail each KV engine write with probability P, as an "
                                     "engine network error would")
    g.add_argument("--fault-status-delay-s", type=float, default=env.status_delay_s,
                   metavar="S", help="prefill: hold every transfer Status S seconds")
    g.add_argument("--fault-drop-handshake-p", type=float, default=env.drop_handshake_p,
                   metavar="P", help="drop each per-room handshake message this node sends "
                                     "(Destination, Status, Abort, AbortAck) with probability P")
    g.add_argument("--fault-slow-peer-s", type=float, default=env.slow_peer_s, metavar="S",
                   help="sleep S seconds before every KV engine write")
    g.add_argument("--fault-seed", type=int, default=env.seed, metavar="N",
                   help="seed of the fault draws (default: random)")


def fault_config(args: argparse.Namespace) -> FaultConfig:
    from transfer.faults import FaultConfig

    return FaultConfig(
        transfer_fail_p=args.fault_transfer_fail_p, status_delay_s=args.fault_status_delay_s,
        drop_handshake_p=args.fault_drop_handshake_p, slow_peer_s=args.fault_slow_peer_s,
        seed=args.fault_seed)


# ---- end of fault injection -----------------------------------------------------------------


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "ascend"])
    p.add_argument("--advertise-host", type=host, default=None,
                   help="address peers use to reach this node's transfer engine and bootstrap "
                        "(default: --host; when --host is a wildcard (0.0.0.0, :: or [::]), the "
                        "machine's host name's address if it is one of its own and not "
                        "loopback, else its one IPv4 address other than loopback: a machine "
                        "with several must be given this flag)")


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")  # bind every interface: not an address for peers


FIB_TRIE = "/proc/net/fib_trie"  # Linux's routes; this network namespace's own addresses among them


def advertise_host(args: argparse.Namespace) -> str:
    """``--advertise-host``; else ``--host``, unless it is a wildcard: then
    :func:`machine_address`."""
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host not in WILDCARD_HOSTS:
        return str(args.host)
    return machine_address(str(args.host))


def machine_address(wildcard: str) -> str:
    """The address other machines reach this node on when it binds ``wildcard``: its host
    name's address when that is one of this machine's own and not a loopback one, else its one
    IPv4 address other than loopback. A host name that resolves to loopback (Debian's
    127.0.1.1, a container's or a network namespace's 127.0.0.1) used to be advertised as it
    was, which no other machine reaches. With several such addresses, or none, the machine
    must be told: :class:`InvalidRequestError` asking for ``--advertise-host``."""
    from engine.errors import InvalidRequestError

    own = local_ipv4_addresses()
    try:
        named: str | None = socket.gethostbyname(socket.gethostname())
    except OSError:  # the host name does not resolve
        named = None
    if named in own:
        return str(named)
    if len(own) == 1:
        return own[0]
    has = f"it has several ({', '.join(own)})" if own else "it has none but loopback"
    raise InvalidRequestError(f"--host {wildcard} binds every interface, and other machines "
                              f"need the one address of this one they reach it on: {has}; "
                              "give it with --advertise-host")


def local_ipv4_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback ones, secondary ones included, in
    order (its network namespace's, read from :data:`FIB_TRIE`: every leaf marked ``/32 host
    LOCAL``); [] where that file cannot be read."""
    try:
        lines = Path(FIB_TRIE).read_text().splitlines()
    except OSError:
        return []
    found, leaf = set(), ""
    for line in lines:
        text = line.strip()
        if text.startswith("|-- "):
            leaf = text[4:]
        elif text == "/32 host LOCAL" and not ipaddress.ip_address(leaf).is_loopback:
            found.add(leaf)
    return sorted(found, key=ipaddress.ip_address)


def add_draft_args(p: argparse.ArgumentParser, *, decode: bool) -> None:
    where = "" if decode else "; on a pipeline-parallel prefill, its last stage only"
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="EAGLE draft directory, in pdserve's layout (e.g. MODEL/draft from "
                        "make-tiny-model --with-draft), the original EAGLE-1/EAGLE-2 one or "
                        "SpecForge's EAGLE-3 one (told apart by its config.json), or 'mtp': "
                        "the Qwen3.5 checkpoint's own MTP module (its mtp.* weights); prefill "
                        f"and decode nodes of a cluster must agree{where}")
    if decode:
        p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K",
                       help="draft tokens per speculative round (with --draft)")
        add_tree_args(p)


def draft_dir(args: argparse.Namespace, model_dir: Path) -> Path | None:
    """The draft directory ``--draft`` names (``mtp``: the model's own checkpoint, whose MTP
    module is the draft), or None without one."""
    from engine.models.eagle.loader import draft_source

    return draft_source(args.draft, model_dir) if args.draft else None


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """``--draft-topk`` and ``--draft-steps``: the EAGLE-2 draft tree beside
    ``--num-draft-tokens`` (checked by :class:`decode_node.spec.tree.TreeShape`)."""
    p.add_argument("--draft-topk", type=int, default=1, metavar="k",
                   help="children per expanded node of the EAGLE-2 draft tree (1 with the "
                        "default --draft-steps: today's chain)")
    p.add_argument("--draft-steps", type=int, default=None, metavar="S",
                   help="depth of the draft tree (default: --num-draft-tokens); "
                        "--num-draft-tokens may be at most topk + (S - 1) * topk^2")
