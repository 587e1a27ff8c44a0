"""Speculative decoding of a hybrid model (Qwen3.5: Gated DeltaNet layers with per-request
states) is exact: with its own MTP module (``--draft mtp``) and with an EAGLE draft directory,
greedy output equals plain decoding token for token (text, images, a video, mixed batches),
because after each verify the state slot holds the state after the accepted tokens only, on one
rank or on two tensor-parallel ranks. Draft trees are refused with their reason; every state
slot and page is free at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decode_node.spec.eagle_engine import (
    HYBRID_TREE_REASON,
    EagleEngine,
    spec_refusal,
)
from decode_node.spec.graph_runner import RoundInputs
from decode_node.spec.tree import TreeShape
from engine.attention.linear.states import LinearStates
from engine.builtin.tiny_model import write_random_draft
from engine.builtin.tiny_qwen3 import (
    make_mtp_predictable,
    tiny_qwen3_config_dict,
    write_tiny_qwen3_model,
)
from engine.config import KEEP_ROWS, REPLAY, EngineConfig, ModelConfig, VerifyStates
from engine.core.request import SamplingParams
from engine.errors import ConfigError
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.models.eagle.mtp import MtpDraft
from engine.multimodal.inputs import ImageInput, RequestState, VideoInput

REPO = Path(__file__).resolve().parents[3]
SPECIAL = tiny_qwen3_config_dict("qwen3_5")
IMG, VID = SPECIAL["image_token_id"], SPECIAL["video_token_id"]
VS, VE = SPECIAL["vision_start_token_id"], SPECIAL["vision_end_token_id"]
PATCH_DIM = 3 * 2 * 16 * 16
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
K = 3


def patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen)


def image_prompt(before: list[int], grid: tuple[int, int, int], after: list[int],
                 seed: int) -> Prompt:
    n = grid[0] * grid[1] * grid[2] // 4
    return Prompt(token_ids=[*before, VS, *[IMG] * n, VE, *after],
                  images=[ImageInput(patches(grid, seed), grid)])


def video_prompt(before: list[int], grid: tuple[int, int, int], seed: int) -> Prompt:
    """A video's frames, each after a 2-token timestamp, between vision start and end."""
    t, h, w = grid
    ids = list(before)
    for i in range(t):
        ids += [40 + i, 41 + i, VS, *[VID] * (h * w // 4), VE]
    return Prompt(token_ids=[*ids, 9], videos=[VideoInput(patches(grid, seed), grid)])


PROMPTS = {
    "text": [Prompt(token_ids=list(range(1, 30))), Prompt(token_ids=[5, 6, 7])],
    "image": [image_prompt([3, 4], (1, 4, 6), [5, 6, 7], 1)],
    "mixed": [Prompt(token_ids=[9, 8, 7]), image_prompt([1], (1, 8, 4), list(range(20, 50)), 2),
              Prompt(token_ids=list(range(100, 160))), video_prompt([11, 12], (2, 4, 4), 3),
              image_prompt([], (1, 4, 4), [11], 4)],
}


def write_mtp_oracle(path: Path) -> Path:
    """The tiny Qwen3.5 of ``make-tiny-model --arch qwen3_5 --with-mtp`` made predictable
    (:func:`make_mtp_predictable`)."""
    return make_mtp_predictable(write_tiny_qwen3_model(path, "qwen3_5", mtp=True))


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mtp_oracle(tmp_path_factory.mktemp("mtp_oracle") / "ckpt")


def engine_config(k: int = K, verify_states: VerifyStates = KEEP_ROWS) -> EngineConfig:
    return EngineConfig(num_pages=256, page_size=8, lookahead_tokens=k,
                        max_num_batched_tokens=24, verify_states=verify_states)


def plain(model_dir: Path, prompts: list[Prompt]) -> list[GenerationResult]:
    return LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(prompts,
                                                                                  GREEDY)


def mtp_engine(model_dir: Path, k: int = K, verify_states: VerifyStates = KEEP_ROWS
               ) -> EagleEngine:
    engine = LLMEngine(model_dir, engine_config(k, verify_states), draft="mtp")
    draft = engine.load_draft()
    assert isinstance(draft, MtpDraft)
    return EagleEngine(engine, draft, k)


def assert_all_free(spec: EagleEngine) -> None:
    spec.engine.scheduler.check_no_leaks()
    stats = spec.engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_pages_used"] == 0


def assert_same_output(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                   atol=1e-4, rtol=0)


def record_kept(spec: EagleEngine) -> list[int]:
    """Every request's accepted window rows, round after round, as the state slots keep them."""
    kept: list[int] = []
    real = spec.graph.keep_states

    def keep(accepted: list[int]) -> None:
        kept.extend(accepted)
        real(accepted)

    spec.graph.keep_states = keep  # type: ignore[method-assign]
    return kept


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("case", list(PROMPTS))
def test_mtp_greedy_equals_plain_decoding(oracle_dir: Path, case: str, k: int) -> None:
    prompts = PROMPTS[case]
    want = plain(oracle_dir, prompts)
    spec = mtp_engine(oracle_dir, k)
    kept = record_kept(spec)
    got = spec.generate(prompts, GREEDY)
    assert_same_output(got, want)
    st = spec.stats
    assert st.rounds > 0 and st.drafted == k * st.rounds
    assert 0 < st.accepted < st.drafted  # drafts accepted and rejected: both paths ran
    assert len(kept) == st.rounds and sum(kept) == st.accepted + st.rounds
    print(f"{case} K={k}: drafted {st.drafted}, accepted {st.accepted}, "
          f"{st.acceptance_length:.2f} tokens per round")
    assert_all_free(spec)


def test_mtp_with_prefix_hits_resumed_at_state_checkpoints_equals_plain(oracle_dir: Path
                                                                       ) -> None:
    """The prefix cache in draft mode: prompts sharing a 40-token prefix (with an image) one
    after the other resume at the state checkpoint at 32 (checkpoints every 16 tokens, keyed
    with the token after the boundary) and decode what plain decoding without a cache does."""
    shared = image_prompt(list(range(1, 10)), (1, 4, 4), list(range(20, 47)), 5)
    prompts = [replace(shared, token_ids=[*(shared.token_ids or []), *tail])
               for tail in ([60, 61], [70, 71, 72], [60, 61])]
    want = [plain(oracle_dir, [p])[0] for p in prompts]
    config = replace(engine_config(), state_checkpoint_interval=16)
    engine = LLMEngine(oracle_dir, config, draft="mtp")
    spec = EagleEngine(engine, engine.load_draft(), K)
    got = [spec.generate([p], GREEDY)[0] for p in prompts]
    assert_same_output(got, want)
    assert engine.stats()["state_checkpoints_restored"] == 2
    assert engine.stats()["prefix_cache_hit_tokens"] == 2 * 32
    assert_all_free(spec)


def test_replayed_verify_states_decode_as_kept_rows_do(oracle_dir: Path) -> None:
    """``verify_states="replay"`` (the verify keeps the rows' inputs and replays the accepted
    ones): plain decoding's output, with the drafted and accepted counts of the kept rows."""
    prompts = PROMPTS["text"]
    want = plain(oracle_dir, prompts)
    rows = mtp_engine(oracle_dir)
    rows.generate(prompts, GREEDY)
    spec = mtp_engine(oracle_dir, verify_states=REPLAY)
    assert spec.engine.states is not None and spec.engine.states.verify_states == REPLAY
    got = spec.generate(prompts, GREEDY)
    assert_same_output(got, want)
    assert (spec.stats.drafted, spec.stats.accepted) == (rows.stats.drafted, rows.stats.accepted)
    assert 0 < spec.stats.accepted < spec.stats.drafted
    assert_all_free(spec)


def test_keeping_every_verified_rows_state_would_diverge(oracle_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness above rests on the accepted rows' states: a loop that kept the state after
    the whole verify window (rejected drafts included) decodes something else."""
    prompts = PROMPTS["text"]
    want = plain(oracle_dir, prompts)
    real = LinearStates.keep

    def every_row(self: LinearStates, accepted: torch.Tensor) -> None:
        real(self, torch.full_like(accepted, self.window))

    monkeypatch.setattr(LinearStates, "keep", every_row)
    got = mtp_engine(oracle_dir).generate(prompts, GREEDY)
    assert [g.token_ids for g in got] != [w.token_ids for w in want]


def force_drafts(spec: EagleEngine, truth: dict[tuple[int, ...], list[int]], vocab: int
                 ) -> None:
    """Replace the draft's guesses with the plain continuation, wrong from the ``r % (K + 1)``-th
    draft of round ``r`` on (all right when that is ``K``): every accepted count ``1..K+1``
    occurs, whatever the draft."""
    rounds = Counter[str]()

    def draft_decode(rnd: RoundInputs) -> tuple[list[list[int]], list[list[None]]]:
        drafts = []
        for req in rnd.reqs:
            out = truth[tuple(req.prompt_token_ids)]
            n = req.num_output_tokens  # the bonus is output n - 1: d_1 guesses output n
            guess = (out[n : n + spec.k] + [0] * spec.k)[: spec.k]
            wrong = rounds[req.request_id] % (spec.k + 1)
            if wrong < spec.k:
                guess[wrong] = (guess[wrong] + 1) % vocab
            rounds[req.request_id] += 1
            drafts.append(guess)
        return drafts, [[None] * spec.k for _ in rnd.reqs]

    spec._draft_decode = draft_decode  # type: ignore[method-assign, assignment]


@pytest.fixture(scope="module")
def full_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 whose rotation turns whole heads (8 frequencies of 16-wide heads): the
    shape an EAGLE draft in pdserve's layout (a Qwen2-style layer, whole-head mrope in the
    target's sections) fits."""
    from tests.conftest import write_hf_qwen3_5_checkpoint

    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    return write_hf_qwen3_5_checkpoint(tmp_path_factory.mktemp("hf35_rope") / "ckpt", seed=2,
                                       rope_parameters=rope)


@pytest.mark.parametrize("forced", [False, True], ids=["its_drafts", "every_depth"])
def test_hybrid_model_with_an_eagle_draft_equals_plain_decoding(
        full_rope_dir: Path, tmp_path: Path, forced: bool) -> None:
    """An EAGLE draft directory beside Qwen3.5 (random: its drafts are rejected), and the same
    loop with drafts forced right up to every depth in turn: output equal to plain decoding."""
    prompts = [Prompt(token_ids=list(range(3, 30))), Prompt(token_ids=[7, 8, 9, 10])]
    want = plain(full_rope_dir, prompts)
    text = json.loads((full_rope_dir / "config.json").read_text())["text_config"]
    engine = LLMEngine(full_rope_dir, engine_config(),
                       draft=write_random_draft(tmp_path / "d", text))
    spec = EagleEngine(engine, engine.load_draft(), K)
    kept = record_kept(spec)
    if forced:
        force_drafts(spec, {tuple(p.token_ids or ()): w.token_ids
                            for p, w in zip(prompts, want, strict=True)},
                     engine.model_config.text.vocab_size)
    got = spec.generate(prompts, GREEDY)
    assert_same_output(got, want)
    if forced:
        assert set(kept) == set(range(1, K + 2))  # every accepted count, the full window too
    assert_all_free(spec)


def test_mtp_positions_come_from_the_input_positions(oracle_dir: Path) -> None:
    """Every forward's 3-D positions, the MTP module's included, are the prompt's rope table
    for prompt rows and ``p + delta`` past it (images and a video in one batch); the module's
    draft extend reads exactly the verify's positions."""
    spec = mtp_engine(oracle_dir)
    seen: list[tuple[str, list[str], torch.Tensor, torch.Tensor]] = []
    spec.position_log = lambda *entry: seen.append(entry)
    reqs = []
    for p in PROMPTS["mixed"]:
        prepared = spec.engine.prepare(p)
        reqs.append(spec.engine.add_request(prepared.token_ids, prepared.images, GREEDY,
                                            videos=prepared.videos))
    tables = {}
    for r in reqs:
        state = r.payload
        assert isinstance(state, RequestState)
        tables[r.request_id] = (state.mrope_table, state.delta)
    while spec.engine.scheduler.has_unfinished():
        spec.step()
    phases = Counter(phase for phase, *_ in seen)
    assert set(phases) == {"prefill", "draft_prefill", "draft_decode", "verify", "draft_extend"}
    assert phases["verify"] == phases["draft_extend"]
    for phase, rows, pos, mrope in seen:
        for col, (rid, p) in enumerate(zip(rows, pos.tolist(), strict=True)):
            table, delta = tables[rid]
            inside = table is not None and p < table.shape[1]
            want = table[:, p].tolist() if inside else [p + delta] * 3
            assert mrope[:, col].tolist() == want, (phase, rid, p)
    verifies = [e for e in seen if e[0] == "verify"]
    extends = [e for e in seen if e[0] == "draft_extend"]
    for v, e in zip(verifies, extends, strict=True):
        assert v[1] == e[1] and torch.equal(v[2], e[2]) and torch.equal(v[3], e[3])
    assert any(d != 0 for _, d in tables.values())
    assert_all_free(spec)


@pytest.mark.slow
def test_mtp_over_two_tensor_parallel_ranks_equals_plain_decoding(oracle_dir: Path) -> None:
    """Two ranks, each with half the linear-attention heads: after every verify each rank's
    slots keep the state after the accepted rows only (KEEP_STATES on the pipe), so a mixed
    batch decodes as plain decoding does, with the drafted and accepted counts of one rank."""
    prompts = PROMPTS["mixed"]
    want = plain(oracle_dir, prompts)
    one = mtp_engine(oracle_dir)
    one.generate(prompts, GREEDY)
    engine = LLMEngine(oracle_dir, replace(engine_config(), tp_size=2), draft="mtp")
    try:
        spec = EagleEngine(engine, engine.load_draft(), K)
        kept = record_kept(spec)
        got = spec.generate(prompts, GREEDY)
        assert_same_output(got, want)
        assert (spec.stats.drafted, spec.stats.accepted) == (one.stats.drafted,
                                                             one.stats.accepted)
        assert 0 < spec.stats.accepted < spec.stats.drafted and len(kept) == spec.stats.rounds
        assert_all_free(spec)
    finally:
        engine.close()


def test_trees_are_refused_with_a_hybrid_model(oracle_dir: Path) -> None:
    text = ModelConfig.from_dir(oracle_dir).text
    assert spec_refusal(text, TreeShape(K)) is None
    assert spec_refusal(text, TreeShape(4, 2)) == HYBRID_TREE_REASON
    assert spec_refusal(text, TreeShape(2, 1, 3)) == HYBRID_TREE_REASON
    engine = LLMEngine(oracle_dir, engine_config(8), draft="mtp")
    with pytest.raises(ConfigError) as info:
        EagleEngine(engine, engine.load_draft(), 4, topk=2)
    assert str(info.value) == HYBRID_TREE_REASON


# ---- pdserve generate --draft mtp ------------------------------------------------------------


def pdserve(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDSERVE_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def rows(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_generate_with_draft_mtp_equals_plain(oracle_dir: Path, tmp_path: Path) -> None:
    """``pdserve generate --draft mtp`` (a text batch, then an image prompt given as patches)
    prints plain decoding's tokens and each prompt's drafted and accepted counts; a draft tree
    with it is one error line, before anything loads."""
    image = image_prompt([3], (1, 4, 6), [5, 6], 7)
    assert image.token_ids is not None
    np.save(tmp_path / "p.npy", image.images[0].patches.numpy())  # type: ignore[union-attr]
    cases = [["--token-ids", "1,2,3,4,5,6,7,8", "--token-ids", "50,60,70"],
             ["--token-ids", ",".join(map(str, image.token_ids)), "--image-patches",
              str(tmp_path / "p.npy"), "--image-grid", "1,4,6"]]
    common = ["generate", "--model", str(oracle_dir), "--json", "--max-new-tokens", "16",
              "--ignore-eos", "--temperature", "0", "--num-pages", "64"]
    for case in cases:
        want = rows(pdserve(tmp_path, *common, *case))
        got = rows(pdserve(tmp_path, *common, *case, "--draft", "mtp", "--num-draft-tokens",
                           str(K)))
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
        for row in got:
            assert row["drafted_tokens"] == K * row["rounds"] > 0
            assert 0 <= row["accepted_tokens"] <= row["drafted_tokens"]
            print(f"drafted {row['drafted_tokens']}, accepted {row['accepted_tokens']}")
    tree = pdserve(tmp_path, *common, "--token-ids", "1,2", "--draft", "mtp",
                   "--num-draft-tokens", "4", "--draft-topk", "2")
    assert tree.returncode == 2 and tree.stderr.strip() == f"error: {HYBRID_TREE_REASON}"
