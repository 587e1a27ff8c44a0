"""The ``pdserve`` command line.

One module per subcommand, each with ``add_<x>_args(parser)`` and ``run_<x>(args) -> int``
(the exit status): ``make-tiny-model`` (:mod:`cli.tiny_model`), ``generate`` (in-process engine,
:mod:`cli.generate`), the servers ``decode``, ``prefill`` and ``router`` (:mod:`cli.decode`,
:mod:`cli.prefill`, :mod:`cli.router`), ``client`` (:mod:`cli.client`), the Ray cluster's
``launch``, ``status`` and ``stop`` (:mod:`cli.launch`) and ``bench`` (:mod:`cli.bench`). Shared
engine, server and transfer flags are in :mod:`cli.engine_args`; where a model comes from without
``--model`` in :mod:`cli.models`.

Those modules import heavy libraries (torch, grpc, ray) only inside their run functions, so
building the parser stays cheap. Every failure prints one ``error:`` line on stderr naming the
cause, never a traceback: exit 2 for the project's errors (:class:`engine.errors.EngineError`),
``OSError``, ``ValueError`` and usage errors, 1 for anything unexpected (named with its type; a
failed subprocess with the last line of its stderr), 130 for Ctrl-C. ``pdserve --debug COMMAND``
lets the exception through, traceback and all. No module of the package imports this one: it is
the entry point (``pdserve``, or ``python -m cli.main``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from cli.bench import add_bench_args, run_bench
from cli.client import add_client_args, run_client
from cli.decode import add_decode_args, run_decode
from cli.generate import add_generate_args, run_generate
from cli.launch import add_launch_args, add_status_args, run_launch, run_status, run_stop
from cli.prefill import add_prefill_args, run_prefill
from cli.router import add_router_args, run_router
from cli.tiny_model import add_tiny_model_args, run_tiny_model
from engine.errors import EngineError

EXCEPTION_LINE = re.compile(r"[\w.]+(Error|Exception)(\(\w+\))?: ")  # "RuntimeError: ..."
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
    ("status", "show a cluster started by launch (--name)", add_status_args, run_status),
    ("stop", "stop a cluster started by launch (--name)", add_status_args, run_stop),
    ("bench", "load-test routers, or --compare setups it starts", add_bench_args, run_bench),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one ``error:`` line (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand's parser sets ``func`` to its run function."""
    parser = OneLineParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a failure (give it before the command)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, run in COMMANDS:
        command = sub.add_parser(name, help=help_text)
        if add_args is not None:
            add_args(command)
        command.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``pdserve`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # building the parser reads PDSERVE_FAULT_* defaults, which may be malformed
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (Exception, KeyboardInterrupt) as exc:
        if argv[:1] == ["--debug"]:  # read here: the parser itself may have failed
            raise
        print(f"error: {describe(exc)}", file=sys.stderr)
        return exit_status(exc)


def describe(exc: BaseException) -> str:
    """``exc`` as one line: the project's own errors as they are, a failed subprocess with its
    stderr's last line, anything else with its type and its message's last line."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, EngineError | OSError | ValueError):
        return " ".join(str(exc).split())
    if isinstance(exc, subprocess.CalledProcessError):
        return _failed_command(exc)
    message = _last_line(str(exc))
    if EXCEPTION_LINE.match(message):  # e.g. the last line of a traceback Ray passed on
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def exit_status(exc: BaseException) -> int:
    """2 for the errors a user causes, 130 for Ctrl-C, 1 for anything unexpected."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 2 if isinstance(exc, EngineError | OSError | ValueError) else 1


def _failed_command(exc: subprocess.CalledProcessError) -> str:
    command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
    stderr = exc.stderr or ""
    last = _last_line(stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr)
    return f"`{command}` exited with status {exc.returncode}" + (f": {last}" if last else "")


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


if __name__ == "__main__":
    sys.exit(main())
