"""Different tensor-parallel sizes on the two sides of a disaggregated cluster, through routers,
over real Mooncake TCP (every rank in its own process, gloo, with its own transfer engine):

- P TP1 -> D TP2: the prefill gathers each decode rank's KV head into its staging buffer and
  writes that rank whole pages;
- P TP2 -> D TP1: each prefill rank writes whole pages of its head into its landing slot of
  the decode, which scatters them into its pages;
- P PP2 x TP2 -> D TP1 and -> D TP2: a prefill of two pipeline stages with two ranks each; every
  rank of every stage writes its heads of its stage's layers, as above (into D TP2: rank to
  rank, each prefill rank its decode rank's whole pages).

(P PP2 -> D TP2 with a TP1 first stage, and P TP2 -> D TP2 alone, run with EAGLE drafts in
tests/cluster/test_eagle_tp_cluster.py.)

Greedy streams equal transformers' ``generate`` (the oracle of
tests/engine/test_generation_vs_transformers.py) for text and image prompts, sent together;
sent again, the decode's prefix cache holds their prompt pages and the prefill sends only the
rest. No request is retried or recomputed, and every node ends idle (the leak check).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.llm_engine import Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_qwen2_5_cluster import request
from tests.engine.test_generation_vs_transformers import NEW_TOKENS, cases, reference

pytestmark = pytest.mark.slow

NAMES = ["text_only", "one_image", "two_images_of_different_sizes", "image_first"]
NODE = ["--port", "0", "--page-size", "8", "--num-pages", "128", "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def nodes(hf_dir: Path) -> Iterator[dict[str, Node]]:
    model = ["--model", str(hf_dir)]
    pp_tp = ["prefill", *model, *NODE, "--pp-size", "2", "--tp-size", "2"]
    started: list[Node] = []
    try:
        started += start_all([[*pp_tp, "--pp-rank", "1"],
                              ["prefill", *model, *NODE],
                              ["prefill", *model, *NODE, "--tp-size", "2"],
                              ["decode", *model, *NODE, "--tp-size", "2"],
                              ["decode", *model, *NODE]])
        last_tp, prefill, prefill2, decode2, decode = started
        started += start_all([[*pp_tp, "--pp-rank", "0", "--pp-next", last_tp.address]])
        first_tp = started[-1]
        router = ["router", *model, "--port", "0"]
        pairs = {"tp1_to_tp2": (prefill, decode2), "tp2_to_tp1": (prefill2, decode),
                 "pp2tp2_to_tp1": (first_tp, decode), "pp2tp2_to_tp2": (first_tp, decode2)}
        started += start_all([[*router, "--prefill", p.address, "--decode", d.address]
                              for p, d in pairs.values()])
        yield {**dict(zip(pairs, started[-len(pairs):], strict=True)), "prefill": prefill,
               "prefill2": prefill2, "first_tp": first_tp, "last_tp": last_tp,
               "decode2": decode2, "decode": decode}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def want(hf_model) -> list[list[int]]:  # noqa: ANN001
    return [reference(hf_model, *cases()[name]) for name in NAMES]


def stream_all(router: Node) -> list[list[gpb.GenerateResponse]]:
    """Every case at once through ``router``: each one's stream of messages."""
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        reqs = [request(Prompt(token_ids=ids, images=ims), NEW_TOKENS)
                for ids, ims in (cases()[n] for n in NAMES)]
        with ThreadPoolExecutor(len(reqs)) as pool:
            return list(pool.map(lambda r: list(stub.Generate(r, timeout=120)), reqs))


PAIRS = {"tp1_to_tp2": "decode2", "tp2_to_tp1": "decode", "pp2tp2_to_tp1": "decode",
         "pp2tp2_to_tp2": "decode2"}


@pytest.mark.parametrize("path", list(PAIRS))
def test_streams_equal_transformers_and_cached_prompts_skip_their_pages(
    path: str, nodes: dict[str, Node], want: list[list[int]]
) -> None:
    decode = nodes[PAIRS[path]].address
    for attempt in ("first", "cached"):
        before = get_stats(decode).kv_pages_not_sent
        streams = stream_all(nodes[path])
        for name, msgs, exp in zip(NAMES, streams, want, strict=True):
            assert [t for m in msgs for t in m.token_ids] == exp, (path, attempt, name)
            assert msgs[-1].finished and msgs[-1].usage.completion_tokens == NEW_TOKENS
        if attempt == "cached":  # every prompt's full pages were in the decode's cache
            assert get_stats(decode).kv_pages_not_sent > before
        assert_all_idle([n.address for n in nodes.values()])
    router = get_stats(nodes[path].address)  # every prompt's KV came over the transfer
    assert (router.kv_retries, router.kv_recomputes, router.transfers_failed) == (0, 0, 0)
