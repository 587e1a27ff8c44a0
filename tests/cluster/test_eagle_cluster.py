"""EAGLE through the whole cluster: a prefill node computing the draft's prompt KV next to the
target's, a decode node running speculative rounds, behind the router; and a colocated EAGLE
worker. (A pipelined prefill whose last stage runs the draft: ``test_eagle_tp_cluster.py`` and
``tests/deploy/test_launch.py``.) Greedy output must equal plain decoding token for token."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engine.builtin.tiny_model import tiny_config_dict, write_tiny_draft, write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from proto.convert import patches_message
from proto.pdserve.v1 import admin_pb2, generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, running
from tests.cluster.stats import get_stats
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
SPECIAL = tiny_config_dict()
IMG, VS, VE = SPECIAL["image_token_id"], SPECIAL["vision_start_token_id"], SPECIAL[
    "vision_end_token_id"]
NODE = ["--port", "0", "--num-pages", "256", "--page-size", "8", "--max-num-batched-tokens", "32"]
NEW = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("eagle-cluster") / "model")
    write_tiny_draft(path / "draft")
    return path


def cases() -> list[tuple[list[int], list[tuple[np.ndarray, tuple[int, int, int]]]]]:
    rng = np.random.default_rng(0)
    img = (rng.standard_normal((24, 1176)).astype("f4"), (1, 4, 6))
    return [
        (list(range(1, 50)), []),
        ([3, VS, *[IMG] * 6, VE, 4, 5], [img]),
        ([7, 8, 9], []),
        ([VS, *[IMG] * 6, VE, *range(30, 70)], [img]),
    ]


def expected(model_dir: Path) -> list[list[int]]:
    engine = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8))
    prompts = [Prompt(token_ids=ids, images=[ImageInput(torch.from_numpy(p), g) for p, g in ims])
               for ids, ims in cases()]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return [r.token_ids for r in results]


def generate_all(router: Node) -> list[gpb.GenerateResponse]:
    """All cases at once (one batch on the decode node); the last message of each."""
    out: list[list[gpb.GenerateResponse]] = [[] for _ in cases()]
    sampling = gpb.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        def run(i: int, ids: list[int], ims: list) -> None:  # noqa: ANN001
            images = [gpb.Image(patches=patches_message(p, g)) for p, g in ims]
            req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), images=images,
                                      sampling=sampling)
            out[i] = list(stub.Generate(req, timeout=120))

        threads = [threading.Thread(target=run, args=(i, ids, ims))
                   for i, (ids, ims) in enumerate(cases())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


def idle(nodes: list[tuple[Node, type]], timeout_s: float = 20.0) -> None:
    """Wait until every node reports no pages, rooms or running requests."""
    for node, stub_cls in nodes:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(node.address) as ch:
            stub = stub_cls(ch)
            while True:
                load = stub.GetLoad(wpb.GetLoadRequest())
                if (load.kv_pages_used, load.rooms_active, load.running_requests) == (0, 0, 0):
                    break
                assert time.monotonic() < deadline, load
                time.sleep(0.05)


def check(streams: list[list[gpb.GenerateResponse]], want: list[list[int]]) -> None:
    for msgs, exp in zip(streams, want, strict=True):
        assert [t for m in msgs for t in m.token_ids] == exp
        usage = msgs[-1].usage
        assert usage.completion_tokens == NEW
        assert usage.drafted_tokens > 0 and 0 <= usage.accepted_tokens <= usage.drafted_tokens


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[list[int]]:
    return expected(model_dir)


TREE = ["--draft-topk", "2", "--draft-steps", "3"]  # an EAGLE-2 tree of 4 nodes
KS = {"1": ["1"], "3": ["3"], "tree": ["4", *TREE]}  # --num-draft-tokens ... (5: colocated)


@contextmanager
def eagle_pairs(model_dir: Path, flavours: dict[str, list[str]]) -> Iterator[dict[str, Node]]:
    """One EAGLE prefill with ``model_dir/draft``, and per flavour (its ``--num-draft-tokens``
    flags) a decode node and a router on the pair, all started at once (the prefill's draft
    work does not depend on the flavour): ``prefill``, ``decode<f>``, ``router<f>``."""
    model, draft = ["--model", str(model_dir)], ["--draft", str(model_dir / "draft")]
    nodes: list[Node] = []
    try:
        nodes += start_all([["prefill", *model, *NODE, *draft],
                            *[["decode", *model, *NODE, *draft, "--num-draft-tokens", *flags]
                              for flags in flavours.values()]])
        p, decodes = nodes[0], nodes[1:]
        nodes += start_all([["router", *model, "--port", "0", "--prefill", p.address,
                             "--decode", d.address] for d in decodes])
        routers = nodes[1 + len(flavours):]
        yield {"prefill": p, **{f"decode{f}": d for f, d in zip(flavours, decodes, strict=True)},
               **{f"router{f}": r for f, r in zip(flavours, routers, strict=True)}}
    finally:
        stop_all(nodes)


@pytest.fixture(scope="module")
def disaggregated(model_dir: Path) -> Iterator[dict[str, Node]]:
    """Per draft length k (or tree) a decode node and a router on one EAGLE prefill."""
    with eagle_pairs(model_dir, KS) as nodes:
        yield nodes


@pytest.mark.parametrize("k", list(KS))
def test_disaggregated_eagle_equals_plain_decoding(disaggregated: dict[str, Node],
                                                   want: list[list[int]], k: str) -> None:
    check(generate_all(disaggregated[f"router{k}"]), want)
    idle([(disaggregated["prefill"], worker_pb2_grpc.PrefillWorkerStub),
          (disaggregated[f"decode{k}"], worker_pb2_grpc.DecodeWorkerStub)])


def test_tree_decode_samples(disaggregated: dict[str, Node]) -> None:
    """A sampled request through the tree decode (lossless tree verification): every token
    arrives, with drafts, and neither node keeps anything of it."""
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 6, 7]), sampling=gpb.SamplingParams(
        max_new_tokens=NEW, temperature=0.8, seed=3, ignore_eos=True))
    with grpc.insecure_channel(disaggregated["routertree"].address) as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
    assert len([t for m in msgs for t in m.token_ids]) == NEW
    assert msgs[-1].usage.drafted_tokens > 0
    idle([(disaggregated["prefill"], worker_pb2_grpc.PrefillWorkerStub),
          (disaggregated["decodetree"], worker_pb2_grpc.DecodeWorkerStub)])


def test_repeated_prompts_hit_both_caches_and_still_equal_plain_decoding(
    disaggregated: dict[str, Node], want: list[list[int]]
) -> None:
    """The cases twice through k=3: the second time the prefill finds their full pages in its
    cache, draft KV included, and the decode holds them too, so only the last pages travel
    (delta transfer)."""
    prefill, decode = disaggregated["prefill"], disaggregated["decode3"]
    check(generate_all(disaggregated["router3"]), want)  # cached now, whatever ran before
    before = get_stats(decode.address)
    check(generate_all(disaggregated["router3"]), want)
    after = get_stats(decode.address)
    assert after.kv_pages_not_sent - before.kv_pages_not_sent == 6 + 1 + 5  # full pages held
    assert get_stats(prefill.address).prefix_cache_hit_tokens > 0
    idle([(prefill, worker_pb2_grpc.PrefillWorkerStub), (decode, worker_pb2_grpc.DecodeWorkerStub)])


def colocated_twice(model_dir: Path, want: list[list[int]], flags: list[str]
                    ) -> admin_pb2.Stats:
    """A colocated EAGLE worker (``model_dir/draft``, ``flags`` after ``--num-draft-tokens``)
    behind a router serves every prompt twice (the second time from its cache), equal to
    ``want`` both times, and ends idle; returns its stats."""
    model = ["--model", str(model_dir)]
    worker = ["decode", *model, *NODE, "--draft", str(model_dir / "draft"),
              "--num-draft-tokens", *flags]
    with running(worker) as [d], running(["router", *model, "--port", "0",
                                          "--colocated", d.address]) as [r]:
        check(generate_all(r), want)
        check(generate_all(r), want)  # again: the prompts' pages come from the cache
        idle([(d, worker_pb2_grpc.DecodeWorkerStub)])
        stats = get_stats(d.address)
    assert stats.drafted_tokens > 0 and stats.spec_rounds > 0
    assert stats.accepted_tokens <= stats.drafted_tokens
    return stats


@pytest.mark.parametrize("tree", [[], TREE], ids=["chain", "tree"])
def test_colocated_eagle_equals_plain_decoding(model_dir: Path, want: list[list[int]],
                                               tree: list[str]) -> None:
    stats = colocated_twice(model_dir, want, ["5", *tree])
    assert stats.prefix_cache_hit_tokens == 8 * (6 + 1 + 5)
    assert 1.0 <= stats.acceptance_length <= 6.0


