"""What ``pdserve bench --compare`` can start, with no heavy import: its command line is built
for every ``pdserve`` command (:mod:`cli.bench`), so the names live here and
:mod:`bench.compare` (gRPC clients, clusters) is imported only when a comparison runs."""

from __future__ import annotations

DEFAULT_TARGETS = ("disaggregated", "colocated", "disaggregated+eagle", "transformers")
NO_CACHE = "-no-cache"  # a target's suffix: the same setup without a prefix cache
TARGETS = (*DEFAULT_TARGETS, "disaggregated" + NO_CACHE, "colocated" + NO_CACHE)
DEFAULT_K = 4  # draft tokens per round of the EAGLE target
