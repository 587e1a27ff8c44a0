"""NEXTN drafting of a hybrid model through the cluster: every node runs ``--draft mtp`` on a
transformers-written tiny Qwen3.5 that carries an MTP module (``mtp.*``, made predictable so
its drafts are accepted part of the time: tests/decode_node/spec/test_mtp_spec.py), real
``pdserve`` processes, real Mooncake TCP. The prefills compute the MTP layer's prompt KV beside
the target's and send it in the draft band with the pages and the linear-attention states; the
decode verifies chains of K drafts and keeps the state after the accepted tokens only.

All five prompts (text, one image, two images, a video, an image with a video) go at once, so
every decode round mixes image, video and text requests (seed 001's case: the draft's mrope
positions in draft extend). Greedy streams equal transformers' ``generate`` on the same
checkpoint, which is plain decoding, in 1P1D, 2P1D, colocated, TP 1 -> TP 2 (each decode rank
keeps its heads' accepted states), TP 2 -> TP 1 and a two-stage pipeline prefill whose last
stage runs the MTP module; every stream reports the drafted and accepted counts the loop gives
in one process (a draft KV that did not travel whole would change them), and every node ends
idle, state slots included. A draft tree with a hybrid model is refused at start with its
reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_node.spec.eagle_engine import HYBRID_TREE_REASON
from engine.builtin.tiny_qwen3 import make_mtp_predictable
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_hybrid_cluster import NAMES, NODE, stream_all
from tests.engine.models.test_qwen3_generation import NEW_TOKENS, cases, reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODES = ["1p1d", "2p1d", "colocated", "tp1_to_tp2", "tp2_to_tp1", "pipeline"]
K = 3


@pytest.fixture(scope="module")
def mtp_dir(hf35_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf35_mtp") / "ckpt"
    shutil.copytree(hf35_dir, path)
    return make_mtp_predictable(path)


@pytest.fixture(scope="module")
def expected(mtp_dir: Path) -> dict[str, list[int]]:
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(mtp_dir).eval()
    return {name: reference(model, *cases()[name]) for name in NAMES}


@pytest.fixture(scope="module")
def counts(mtp_dir: Path) -> dict[str, tuple[int, int]]:
    """Each prompt's (drafted, accepted) counts from the EAGLE loop in this process, the same
    prompts batched at once: what every mode must report (a draft KV that did not travel whole
    would change them)."""
    from decode_node.spec.eagle_engine import EagleEngine
    from engine.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.llm_engine import LLMEngine, Prompt
    from engine.multimodal.inputs import ImageInput, VideoInput

    engine = LLMEngine(mtp_dir, EngineConfig(num_pages=128, page_size=8, lookahead_tokens=K,
                                             max_num_batched_tokens=16), draft="mtp")
    spec = EagleEngine(engine, engine.load_draft(), K)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = {}
    for name in NAMES:
        ids, visuals = cases()[name]
        p = engine.prepare(Prompt(token_ids=ids,
                                  images=[v for v in visuals if isinstance(v, ImageInput)],
                                  videos=[v for v in visuals if isinstance(v, VideoInput)]))
        reqs[name] = engine.add_request(p.token_ids, p.images, greedy, videos=p.videos)
    while engine.scheduler.has_unfinished():
        spec.step()
    stats = {name: spec.request_stats[r.request_id] for name, r in reqs.items()}
    return {name: (s.drafted, s.accepted) for name, s in stats.items()}


@pytest.fixture(scope="module")
def nodes(mtp_dir: Path) -> Iterator[dict[str, Node]]:
    model, draft = ["--model", str(mtp_dir)], ["--draft", "mtp"]
    started: list[Node] = []
    try:
        pp = ["prefill", *model, *NODE, "--pp-size", "2"]
        started += start_all([["prefill", *model, *NODE, *draft],
                              ["prefill", *model, *NODE, *draft],
                              ["decode", *model, *NODE, *draft, "--num-draft-tokens", str(K)],
                              ["prefill", *model, *NODE, *draft, "--tp-size", "2"],
                              ["decode", *model, *NODE, *draft, "--num-draft-tokens", str(K),
                               "--tp-size", "2"],
                              [*pp, *draft, "--pp-rank", "1"]])
        p1, p2, d, p_tp2, d_tp2, last = started
        started += start_all([[*pp, "--pp-rank", "0", "--pp-next", last.address]])
        first = started[-1]
        router = ["router", *model, "--port", "0"]
        started += start_all([
            [*router, "--prefill", p1.address, "--decode", d.address],
            [*router, "--prefill", p1.address, "--prefill", p2.address, "--decode", d.address],
            [*router, "--colocated", d.address],
            [*router, "--prefill", p1.address, "--decode", d_tp2.address],
            [*router, "--prefill", p_tp2.address, "--decode", d.address],
            [*router, "--prefill", first.address, "--decode", d.address],
        ])
        yield {**dict(zip(MODES, started[-len(MODES):], strict=True)), "decode": d,
               "d_tp2": d_tp2, "p1": p1, "p2": p2, "p_tp2": p_tp2, "first": first,
               "last": last}
    finally:
        stop_all(started)


@pytest.mark.parametrize("mode", MODES)
def test_mtp_streams_equal_plain_decoding(mode: str, nodes: dict[str, Node],
                                          expected: dict[str, list[int]],
                                          counts: dict[str, tuple[int, int]]) -> None:
    decode = nodes["d_tp2" if mode == "tp1_to_tp2" else "decode"]
    before = get_stats(decode.address)
    streams = stream_all(nodes[mode], NAMES)
    drafted = accepted = 0
    for name, msgs in zip(NAMES, streams, strict=True):
        assert [t for m in msgs for t in m.token_ids] == expected[name], (mode, name)
        usage = msgs[-1].usage
        assert msgs[-1].finished and usage.completion_tokens == NEW_TOKENS
        assert (usage.drafted_tokens, usage.accepted_tokens) == counts[name], (mode, name)
        drafted, accepted = drafted + usage.drafted_tokens, accepted + usage.accepted_tokens
    assert 0 < accepted < drafted, mode  # accepted and rejected drafts both ran
    after = get_stats(decode.address)
    assert after.spec_rounds > before.spec_rounds
    router = get_stats(nodes[mode].address)
    assert router.kv_retries == router.kv_recomputes == 0, mode  # the transfer carried them
    assert_all_idle([n.address for n in nodes.values()])


def test_a_draft_tree_of_a_hybrid_model_is_refused_at_start(mtp_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "decode", "--model", str(mtp_dir), *NODE,
         "--draft", "mtp", "--num-draft-tokens", "4", "--draft-topk", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(HYBRID_TREE_REASON), proc.stderr
