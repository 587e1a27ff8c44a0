"""The ``pdserve`` command line.

One module per subcommand, each with ``add_<x>_args(parser)`` and ``run_<x>(args) -> int``
(the exit status): ``make-tiny-model`` (:mod:`cli.tiny_model`), ``generate`` (in-process engine,
:mod:`cli.generate`), the servers ``decode``, ``prefill`` and ``router`` (:mod:`cli.decode`,
:mod:`cli.prefill`, :mod:`cli.router`), ``client`` (:mod:`cli.client`), the Ray cluster's
``launch``, ``status`` and ``stop`` (:mod:`cli.launch`) and ``bench`` (:mod:`cli.bench`). Shared
engine, server and transfer flags are in :mod:`cli.engine_args`; where a model comes from without
``--model`` in :mod:`cli.models`.

Those modules import heavy libraries (torch, grpc, ray) only inside their run functions, so
building the parser stays cheap. User errors print one ``error:`` line and exit 2. No module of
the package imports this one: it is the entry point (``pdserve``, or ``python -m cli.main``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from cli.bench import add_bench_args, run_bench
from cli.client import add_client_args, run_client
from cli.decode import add_decode_args, run_decode
from cli.generate import add_generate_args, run_generate
from cli.launch import add_launch_args, run_launch, run_status, run_stop
from cli.prefill import add_prefill_args, run_prefill
from cli.router import add_router_args, run_router
from cli.tiny_model import add_tiny_model_args, run_tiny_model
from engine.errors import EngineError

AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

# (name, help, flags, body), in the order ``pdserve --help`` lists them
COMMANDS: tuple[tuple[str, str, AddArgs | None, Run], ...] = (
    ("make-tiny-model", "write the built-in tiny random checkpoint", add_tiny_model_args,
     run_tiny_model),
    ("generate", "run the engine in this process (no servers)", add_generate_args, run_generate),
    ("decode", "run a decode worker (gRPC DecodeWorker)", add_decode_args, run_decode),
    ("prefill", "run a prefill worker (gRPC PrefillWorker)", add_prefill_args, run_prefill),
    ("router", "run the router (public gRPC Generation API)", add_router_args, run_router),
    ("client", "stream one answer from a router", add_client_args, run_client),
    ("launch", "start router, prefill and decode workers on Ray", add_launch_args, run_launch),
    ("status", "show the detached cluster started by launch", None, run_status),
    ("stop", "stop the detached cluster started by launch", None, run_stop),
    ("bench", "load-test routers, or --compare setups it starts", add_bench_args, run_bench),
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand's parser sets ``func`` to its run function."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, run in COMMANDS:
        command = sub.add_parser(name, help=help_text)
        if add_args is not None:
            add_args(command)
        command.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``pdserve`` command line; returns the exit status."""
    try:  # building the parser reads PDSERVE_FAULT_* defaults, which may be malformed
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (EngineError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
