"""A hybrid model (Qwen3.5: Gated DeltaNet and gated full-attention layers) through the cluster:
real ``pdserve`` processes on a transformers-written tiny Qwen3.5 checkpoint, real Mooncake TCP,
greedy streams equal to transformers' ``generate`` (the oracle of
tests/engine/models/test_qwen3_generation.py) for text, one image, two images, a video and an
image with a video, all sent at once (a mixed batch on every node).

Every disaggregated path carries each prompt's final conv and recurrent states beside its KV
pages, paired by global layer id, into the decode's reserved state slot: 1P1D, 2P1D, TP 1 -> TP 2
(each decode rank gets its half of the linear-attention heads, the conv channels with them) and
TP 2 -> TP 1 (both prefill ranks write halves of one slot) and a two-stage pipeline prefill
(each stage holds one linear-attention and one full-attention layer and writes its own, by
global id, into the one slot and the same pages), also with two TP ranks per stage into a TP 2
decode; the colocated path computes the prompt on the decode. A TP 2 prefill of a model with
one (replicated) KV head has rank 1 write states and no KV. The prefills run 16-token
chunks, so states cross chunk borders. Every node ends idle, state slots included (the leak
check).

The prefix cache is on everywhere (state checkpoints every 16 tokens), and the modes send the
same prompts to the same nodes: a prefill's repeated prompt resumes from its KV and its state
checkpoint, and a decode's cached pages are not sent again (delta transfer: the missing KV and
the final state), the streams still equal transformers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.llm_engine import Prompt
from engine.multimodal.inputs import ImageInput, VideoInput
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_qwen2_5_cluster import request
from tests.engine.models.test_qwen3_generation import IMG, NEW_TOKENS, cases, reference

pytestmark = pytest.mark.slow

NAMES = ["text", "one_image", "two_images", "video", "image_and_video"]
NODE = ["--port", "0", "--page-size", "8", "--num-pages", "128", "--max-num-batched-tokens", "16",
        "--state-checkpoint-interval", "16"]
MODES = ["1p1d", "2p1d", "colocated", "tp1_to_tp2", "tp2_to_tp1", "pipeline", "pipeline_tp2"]


def qwen3_request(name: str) -> gpb.GenerateRequest:
    """The wire request of case ``name``: each image's run of pads collapsed to one placeholder
    (the router expands it), each video as expanded as the case gives it (its frame blocks
    between their timestamps' tokens: the router keeps an expanded prompt as it is)."""
    ids, visuals = cases()[name]
    msg = request(Prompt(token_ids=ids, images=[v for v in visuals if isinstance(v, ImageInput)],
                         videos=[v for v in visuals if isinstance(v, VideoInput)]), NEW_TOKENS)
    images = [t for i, t in enumerate(ids) if t == IMG and (i == 0 or ids[i - 1] != IMG)]
    msg.token_ids.ids[:] = [t for i, t in enumerate(ids)
                            if t != IMG or i == 0 or ids[i - 1] != IMG]
    assert len(images) == len(msg.images)
    return msg


@pytest.fixture(scope="module")
def expected(hf35_model) -> dict[str, list[int]]:  # noqa: ANN001
    return {name: reference(hf35_model, *cases()[name]) for name in NAMES}


@pytest.fixture(scope="module")
def nodes(hf35_dir: Path) -> Iterator[dict[str, Node]]:
    model = ["--model", str(hf35_dir)]
    started: list[Node] = []
    try:
        pp = ["prefill", *model, *NODE, "--pp-size", "2"]
        started += start_all([["prefill", *model, *NODE], ["prefill", *model, *NODE],
                              ["decode", *model, *NODE],
                              ["prefill", *model, *NODE, "--tp-size", "2"],
                              ["decode", *model, *NODE, "--tp-size", "2"],
                              [*pp, "--pp-rank", "1"], [*pp, "--tp-size", "2", "--pp-rank", "1"]])
        p1, p2, d, p_tp2, d_tp2, last, last_tp2 = started
        started += start_all([[*pp, "--pp-rank", "0", "--pp-next", last.address],
                              [*pp, "--tp-size", "2", "--pp-rank", "0", "--pp-next",
                               last_tp2.address]])
        first, first_tp2 = started[-2:]
        router = ["router", *model, "--port", "0"]
        started += start_all([
            [*router, "--prefill", p1.address, "--decode", d.address],
            [*router, "--prefill", p1.address, "--prefill", p2.address, "--decode", d.address],
            [*router, "--colocated", d.address],
            [*router, "--prefill", p1.address, "--decode", d_tp2.address],
            [*router, "--prefill", p_tp2.address, "--decode", d.address],
            [*router, "--prefill", first.address, "--decode", d.address],
            [*router, "--prefill", first_tp2.address, "--decode", d_tp2.address],
        ])
        yield {**dict(zip(MODES, started[-len(MODES):], strict=True)),
               "p1": p1, "p2": p2, "decode": d, "p_tp2": p_tp2, "d_tp2": d_tp2,
               "first": first, "last": last, "first_tp2": first_tp2, "last_tp2": last_tp2}
    finally:
        stop_all(started)


def stream_all(router: Node, names: list[str]) -> list[list[gpb.GenerateResponse]]:
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(len(names)) as pool:
            return list(pool.map(
                lambda n: list(stub.Generate(qwen3_request(n), timeout=180)),
                names))


@pytest.mark.parametrize("mode", MODES)
def test_streams_equal_transformers(mode: str, nodes: dict[str, Node],
                                    expected: dict[str, list[int]]) -> None:
    streams = stream_all(nodes[mode], NAMES)
    for name, msgs in zip(NAMES, streams, strict=True):
        assert [t for m in msgs for t in m.token_ids] == expected[name], (mode, name)
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == NEW_TOKENS
    router = get_stats(nodes[mode].address)
    assert router.kv_retries == router.kv_recomputes == 0, mode  # the transfer carried them
    decode = get_stats(nodes["decode"].address)
    assert decode.state_slots_total > 0
    assert_all_idle([n.address for n in nodes.values()])


def test_prefix_hits_on_both_sides_keep_the_streams(nodes: dict[str, Node],
                                                    expected: dict[str, list[int]]) -> None:
    """Each prompt twice through 1P1D: the second time the prefill resumes at a state
    checkpoint and the decode asks for fewer pages, and the streams stay transformers'."""
    before_p, before_d = get_stats(nodes["p1"].address), get_stats(nodes["decode"].address)
    for _ in range(2):
        for name, msgs in zip(NAMES, stream_all(nodes["1p1d"], NAMES), strict=True):
            assert [t for m in msgs for t in m.token_ids] == expected[name], name
    after_p, after_d = get_stats(nodes["p1"].address), get_stats(nodes["decode"].address)
    assert after_p.prefix_cache_hit_tokens > before_p.prefix_cache_hit_tokens
    assert after_p.state_checkpoints_restored > before_p.state_checkpoints_restored
    assert after_p.state_checkpoint_bytes > 0 and after_p.state_checkpoints_cached > 0
    assert after_d.kv_pages_not_sent > before_d.kv_pages_not_sent
    assert_all_idle([n.address for n in nodes.values()])


@pytest.fixture(scope="module")
def one_kv_head(hf35_one_kv_head_dir: Path) -> Iterator[Node]:
    """A TP 2 prefill of a Qwen3.5 whose one KV head both ranks replicate, behind a router to a
    TP 1 decode: rank 0 alone writes the KV (the lowest replica), each rank its half of the
    linear-attention heads, so rank 1 sends states only."""
    model = ["--model", str(hf35_one_kv_head_dir)]
    started: list[Node] = []
    try:
        started += start_all([["prefill", *model, *NODE, "--tp-size", "2"],
                              ["decode", *model, *NODE]])
        p, d = started
        started += start_all([["router", *model, "--port", "0", "--prefill", p.address,
                               "--decode", d.address]])
        yield started[-1]
        assert_all_idle([n.address for n in started])
    finally:
        stop_all(started)


def test_states_from_a_rank_that_writes_no_kv(one_kv_head: Node, hf35_one_kv_head_model) -> None:  # noqa: ANN001
    names = ["text", "one_image"]
    streams = stream_all(one_kv_head, names)
    for name, msgs in zip(names, streams, strict=True):
        want = reference(hf35_one_kv_head_model, *cases()[name])
        assert [t for m in msgs for t in m.token_ids] == want, name
    stats = get_stats(one_kv_head.address)
    assert stats.kv_retries == stats.kv_recomputes == 0
