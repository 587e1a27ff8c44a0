"""EAGLE-3 through the whole cluster: a prefill node fusing the target's layer outputs into the
draft's feature and computing the draft's prompt KV, decode nodes running chain and tree rounds
behind routers, twice (the second time from both prefix caches), and a colocated EAGLE-3 worker.
Greedy output must equal plain decoding token for token; with a draft built to reproduce its
target, every guess of a token in the draft's vocabulary is accepted through the prefill node's
aux row (the fused feature it ships) and the decode's rounds. (An EAGLE-3 draft on a
pipeline-parallel prefill: tests/cluster/test_eagle_tp_cluster.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from tests.cluster.harness import Node, running
from tests.cluster.stats import get_stats
from tests.cluster.test_eagle_cluster import (
    NODE,
    TREE,
    check,
    colocated_twice,
    eagle_pairs,
    expected,
    generate_all,
    idle,
)
from tests.eagle3_pair import draft_vocab_ids, write_eagle3_model, write_repeating_pair

pytestmark = pytest.mark.slow
FLAVOURS = {"chain": ["3"], "tree": ["4", *TREE]}  # --num-draft-tokens ...


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle3_model(tmp_path_factory.mktemp("eagle3-cluster"))


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[list[int]]:
    return expected(model_dir)


@pytest.fixture(scope="module")
def disaggregated(model_dir: Path) -> Iterator[dict[str, Node]]:
    """One EAGLE-3 prefill; per flavour (chain, tree) a decode node and a router on the pair."""
    with eagle_pairs(model_dir, FLAVOURS) as nodes:
        yield nodes


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_disaggregated_eagle3_equals_plain_decoding(disaggregated: dict[str, Node],
                                                    want: list[list[int]], flavour: str) -> None:
    """Twice: the second pass finds the prompts' full pages (draft band included) in the
    prefill's cache and the decode's, and only the last pages travel."""
    decode = disaggregated[f"decode{flavour}"]
    for _ in range(2):
        check(generate_all(disaggregated[f"router{flavour}"]), want)
    assert get_stats(disaggregated["prefill"].address).prefix_cache_hit_tokens > 0
    idle([(disaggregated["prefill"], worker_pb2_grpc.PrefillWorkerStub),
          (decode, worker_pb2_grpc.DecodeWorkerStub)])


@pytest.mark.parametrize("tree", [[], TREE], ids=["chain", "tree"])
def test_colocated_eagle3_equals_plain_decoding(model_dir: Path, want: list[list[int]],
                                                tree: list[str]) -> None:
    colocated_twice(model_dir, want, ["4", *tree])


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_reproducing_eagle3_draft_is_accepted_across_nodes(tmp_path: Path,
                                                            flavour: str) -> None:
    """The repeating pair (tests/eagle3_pair.py) disaggregated: the first draft token of every
    round comes from the feature the prefill shipped or the last draft extend, so a prompt
    ending in a draft-vocabulary token has every draft accepted, one ending outside none."""
    pair = write_repeating_pair(tmp_path / "pair", draft_vocab=128)
    inside = draft_vocab_ids(128)
    hit = next(t for t in range(20, 512) if t in inside)
    miss = next(t for t in range(20, 512) if t not in inside)
    model, draft = ["--model", str(pair)], ["--draft", str(pair / "draft")]
    flags = FLAVOURS[flavour]
    depth = 3  # the chain's num_draft_tokens and the tree's steps
    new = 1 + 3 * (depth + 1)
    with running(["prefill", *model, *NODE, *draft]) as [p], running(
            ["decode", *model, *NODE, *draft, "--num-draft-tokens", *flags]) as [d], running(
            ["router", *model, "--port", "0", "--prefill", p.address,
             "--decode", d.address]) as [r], grpc.insecure_channel(r.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for last, accepted in ((hit, 3 * depth), (miss, 0)):
            req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 6, last]),
                                      sampling=gpb.SamplingParams(max_new_tokens=new,
                                                                  ignore_eos=True))
            msgs = list(stub.Generate(req, timeout=60))
            assert [t for m in msgs for t in m.token_ids] == [last] * new
            assert (msgs[-1].usage.accepted_tokens, msgs[-1].usage.drafted_tokens > 0) == (
                accepted, True)
