"""EAGLE with tensor parallelism in a disaggregated cluster, through routers over real Mooncake
TCP (every rank in its own process, gloo, with its own transfer engine). Each worker splits the
draft's layer over its ranks like the target's, so its KV band travels head slice by head slice
like the target's layers:

- P TP1 -> D TP2 (a K = 3 chain): the prefill gathers each decode rank's heads of the target's
  and the draft's layers into its staging buffer;
- P TP2 -> D TP1 (a tree of 4 nodes, top-2, 3 steps): each prefill rank writes its heads;
- P TP2 -> D TP2 (the chain): rank to rank.

Text and image prompts go in together. Greedy streams equal plain decoding, and each request's
drafted and accepted counts equal those of the same EAGLE loop in one process: the draft
approximates its target, so acceptance depends on the draft KV every decode rank received.
Nothing is retried or recomputed, and every node ends idle (the leak check).

Last, four KV heads and an EAGLE-3 draft on a two-stage prefill whose last stage runs TP 4,
into a D TP2: the first stage sends its layer's output on with the hidden states and the last
fuses it with its own (tests/prefill_node/test_pipeline_draft.py checks the draft KV and the
shipped feature exactly); two of the last stage's ranks write slices of each decode rank's
heads, which land in that rank's slots (rank 1's made and scattered by its landing agent, in its
process), draft band included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.builtin.tiny_model import (
    TINY_EAGLE3_LAYERS,
    init_weights,
    write_random_eagle3_draft,
    write_tiny_model,
)
from engine.checkpoint import save_weights
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.draft import Eagle3Spec
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.multimodal.inputs import ImageInput
from tests.cluster.harness import Node, free_port
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_eagle_cluster import NEW, NODE, cases, generate_all
from tests.decode_node.test_eagle import write_oracle_pair

pytestmark = pytest.mark.slow

CHAIN, TREE = (3, 1, 3), (4, 2, 3)  # (num_draft_tokens, topk, steps)
ROUTES = {"tp1_to_tp2": ("prefill1", "decode2", CHAIN), "tp2_to_tp1": ("prefill2", "decode1", TREE),
          "tp2_to_tp2": ("prefill2", "decode2", CHAIN)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_oracle_pair(tmp_path_factory.mktemp("eagle-tp") / "pair", exact=False)


def shape_flags(shape: tuple[int, int, int]) -> list[str]:
    n, k, s = shape
    return ["--num-draft-tokens", str(n), "--draft-topk", str(k), "--draft-steps", str(s)]


@pytest.fixture(scope="module")
def nodes(model_dir: Path) -> Iterator[dict[str, Node]]:
    model, draft = ["--model", str(model_dir)], ["--draft", str(model_dir / "draft")]
    tp2 = ["--tp-size", "2"]
    started: list[Node] = []
    try:
        started += start_all([["prefill", *model, *NODE, *draft],
                              ["prefill", *model, *NODE, *draft, *tp2],
                              ["decode", *model, *NODE, *draft, *shape_flags(TREE)],
                              ["decode", *model, *NODE, *draft, *tp2, *shape_flags(CHAIN)]])
        workers = dict(zip(["prefill1", "prefill2", "decode1", "decode2"], started, strict=True))
        started += start_all([["router", *model, "--port", "0", "--prefill",
                               workers[p].address, "--decode", workers[d].address]
                              for p, d, _ in ROUTES.values()])
        yield {**workers, **dict(zip(ROUTES, started[len(workers):], strict=True))}
    finally:
        stop_all(started)


def one_process(model_dir: Path, shape: tuple[int, int, int]
                ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Plain greedy tokens of every case, and each case's (drafted, accepted) in the EAGLE loop
    of ``shape`` in one process."""
    prompts = [Prompt(token_ids=ids, images=[ImageInput(torch.from_numpy(p), g) for p, g in ims])
               for ids, ims in cases()]
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(prompts,
                                                                                   greedy)
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=TreeShape(*shape).lookahead)
    engine = LLMEngine(model_dir, config, draft=model_dir / "draft")
    spec = EagleEngine(engine, engine.load_draft(), *shape)
    got = spec.generate(prompts, greedy)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    stats = [spec.request_stats[g.request_id] for g in got]
    return [p.token_ids for p in plain], [(s.drafted, s.accepted) for s in stats]


@pytest.mark.parametrize("route", list(ROUTES))
def test_streams_and_acceptance_equal_the_one_process_eagle_loop(
    route: str, nodes: dict[str, Node], model_dir: Path
) -> None:
    want, counts = one_process(model_dir, ROUTES[route][2])
    assert sum(a for _, a in counts) > 0  # drafts are accepted: the draft KV matters
    streams = generate_all(nodes[route])
    assert [[t for m in msgs for t in m.token_ids] for msgs in streams] == want
    usage = [msgs[-1].usage for msgs in streams]
    assert [(u.drafted_tokens, u.accepted_tokens) for u in usage] == counts
    assert_all_idle([n.address for n in nodes.values()])
    router = get_stats(nodes[route].address)  # every prompt's KV came over the transfer
    assert (router.kv_retries, router.kv_recomputes, router.transfers_failed) == (0, 0, 0)


@pytest.fixture(scope="module")
def four_kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two-layer tiny model with four KV heads (one per query head) and a random EAGLE-3
    draft of layers (1, 0, 1): one on each pipeline stage, out of order and repeated."""
    path = write_tiny_model(tmp_path_factory.mktemp("four-kv") / "model")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["num_key_value_heads"] = 4
    model = Qwen2VLModel(ModelConfig.from_dict(raw))
    init_weights(model, seed=4)
    save_weights(model, path)
    (path / "config.json").write_text(json.dumps(raw))
    vocab = raw["text_config"]["vocab_size"]
    write_random_eagle3_draft(path / "draft", raw["text_config"],
                              Eagle3Spec(TINY_EAGLE3_LAYERS, vocab // 2))
    return path


def test_an_eagle3_tp_pipeline_prefill_lands_in_every_rank_of_a_tp2_decode(
        four_kv_dir: Path) -> None:
    """Stage 0 (TP 1) gathers each decode rank's heads of its layer into its staging buffer;
    stage 1 (TP 4, the EAGLE-3 draft split over its ranks, fusing stage 0's layer output that
    came with the hidden states) has two of its ranks write slices of each decode rank's heads,
    which land in that rank's slots, draft band included. Twice: the second time from the
    decode's prefix cache."""
    model, draft = ["--model", str(four_kv_dir)], ["--draft", str(four_kv_dir / "draft")]
    stage = ["prefill", *model, *NODE, "--pp-size", "2"]
    last_port = free_port()
    want, counts = one_process(four_kv_dir, CHAIN)
    started: list[Node] = []
    try:  # a later --port wins over NODE's
        started += start_all([[*stage, "--pp-rank", "1", "--port", str(last_port), *draft,
                               "--tp-size", "4"],
                              [*stage, "--pp-rank", "0", "--pp-next", f"127.0.0.1:{last_port}"],
                              ["decode", *model, *NODE, *draft, "--tp-size", "2",
                               *shape_flags(CHAIN)]])
        _, first, decode = started
        started += start_all([["router", *model, "--port", "0", "--prefill", first.address,
                               "--decode", decode.address]])
        for _ in range(2):
            streams = generate_all(started[-1])
            assert [[t for m in msgs for t in m.token_ids] for msgs in streams] == want
            usage = [msgs[-1].usage for msgs in streams]
            assert [(u.drafted_tokens, u.accepted_tokens) for u in usage] == counts
            assert all(u.drafted_tokens > 0 for u in usage)
        assert get_stats(decode.address).kv_pages_not_sent > 0  # the second pass's cache hits
        assert_all_idle([n.address for n in started])
        router = get_stats(started[-1].address)
        assert (router.kv_retries, router.kv_recomputes, router.transfers_failed) == (0, 0, 0)
    finally:
        stop_all(started)
