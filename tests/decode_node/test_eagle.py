"""EAGLE speculative decoding: exactly plain decoding under greedy sampling, full acceptance with a
draft that reproduces the target, positions audited in every phase, lossless sampling."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from decode_node.spec.accept import accept_sampled, chain_sampled, draw, row_probs
from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.builtin.tiny_model import (
    init_weights,
    tiny_config_dict,
    write_tiny_draft,
    write_tiny_model,
)
from engine.checkpoint import save_weights
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.models.eagle.draft import DraftConfig, EagleDraft, draft_config_dict
from engine.models.eagle.loader import load_draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.multimodal.inputs import ImageInput
from engine.multimodal.mrope import rope_index
from engine.sampling.sampler import make_generator

SPECIAL = tiny_config_dict()
IMG, VS, VE = SPECIAL["image_token_id"], SPECIAL["vision_start_token_id"], SPECIAL[
    "vision_end_token_id"]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("eagle") / "model")
    write_tiny_draft(path / "draft")
    return path


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.randn(grid[0] * grid[1] * grid[2], 1176, generator=gen), grid)


def image_prompt(before: list[int], grid: tuple[int, int, int], after: list[int],
                 seed: int) -> Prompt:
    n = grid[0] * grid[1] * grid[2] // 4
    return Prompt(token_ids=[*before, VS, *[IMG] * n, VE, *after], images=[image(grid, seed)])


PROMPTS = {
    "text": [Prompt(token_ids=list(range(1, 40)))],
    "image": [image_prompt([3, 4], (1, 4, 6), [5, 6, 7], 1)],
    "mixed": [Prompt(token_ids=[9, 8, 7]), image_prompt([1], (1, 8, 4), list(range(20, 50)), 2),
              Prompt(token_ids=list(range(100, 160))), image_prompt([], (1, 4, 4), [11], 3)],
}


def spec_engine(model_dir: Path, k: int, **cfg: int) -> EagleEngine:
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=k,
                          max_num_batched_tokens=cfg.get("chunk", 24))
    engine = LLMEngine(model_dir, config)
    draft = load_draft(model_dir / "draft", engine.model_config.text, torch.float32)
    return EagleEngine(engine, draft, k)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("case", list(PROMPTS))
def test_greedy_equals_plain_decoding(model_dir: Path, case: str, k: int) -> None:
    prompts = PROMPTS[case]
    plain = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(prompts,
                                                                                   GREEDY)
    spec = spec_engine(model_dir, k)
    got = spec.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert_same_logprobs(got, plain)
    assert spec.stats.rounds > 0 and spec.stats.drafted == k * spec.stats.rounds
    spec.engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("tree", [(3, 1, 3), (4, 2, 3)], ids=["chain", "tree"])
def test_top_logprobs_equal_plain_decoding(model_dir: Path, tree: tuple[int, int, int]) -> None:
    """Every committed token's alternatives are the ones plain decoding reports (the first
    token's from the prefill's sample, the rest from verify rows), in chain and tree rounds."""
    asking = SamplingParams(max_new_tokens=24, ignore_eos=True, top_logprobs=4)
    prompts = PROMPTS["mixed"]
    plain = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(prompts,
                                                                                   asking)
    n, k, s = tree
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=TreeShape(n, k, s).lookahead,
                          max_num_batched_tokens=24)
    engine = LLMEngine(model_dir, config)
    draft = load_draft(model_dir / "draft", engine.model_config.text, torch.float32)
    spec = EagleEngine(engine, draft, n, k, s)
    got = spec.generate(prompts, asking)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    for g, p in zip(got, plain, strict=True):
        assert len(g.top_logprobs) == len(g.token_ids)
        assert [t.token_ids for t in g.top_logprobs] == [t.token_ids for t in p.top_logprobs]
        torch.testing.assert_close(torch.tensor([t.logprobs for t in g.top_logprobs]),
                                   torch.tensor([t.logprobs for t in p.top_logprobs]),
                                   atol=1e-4, rtol=0)
    assert spec.stats.rounds > 0
    spec.engine.scheduler.check_no_leaks()


def assert_same_logprobs(got: list[GenerationResult], plain: list[GenerationResult]) -> None:
    """Each committed token's logprob is the one plain decoding reports for it (a verify row's
    logits equal a decode step's up to float rounding)."""
    for g, p in zip(got, plain, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(p.logprobs),
                                   atol=1e-4, rtol=0)


def write_oracle_pair(path: Path, exact: bool = True) -> Path:
    """A one-layer target whose attention output is zero (each position's logits depend on its
    own token only) and an EAGLE head that reproduces it exactly: ``fc`` passes the token
    embedding through, its layer and norm are the target's. The draft then predicts exactly the
    target's next token.

    With ``exact=False`` the target has two layers and keeps its attention, and the same head
    (a copy of layer 0) only approximates it: drafts are accepted some of the time."""
    from engine.builtin.tiny_tokenizer import build_tiny_tokenizer

    layers = 1 if exact else 2
    raw = tiny_config_dict()
    raw["text_config"]["num_hidden_layers"] = layers
    path.mkdir(parents=True)
    target = Qwen2VLModel(ModelConfig.from_dict(raw))
    init_weights(target, seed=3)
    if exact:
        with torch.no_grad():
            target.model.layers[0].self_attn.o_proj.weight.zero_()
    save_weights(target, path)
    (path / "config.json").write_text(json.dumps(raw))
    build_tiny_tokenizer().save(str(path / "tokenizer.json"))
    draft_raw = draft_config_dict(raw["text_config"], layers)
    draft = EagleDraft(DraftConfig.from_dict(draft_raw))
    hidden = raw["text_config"]["hidden_size"]
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
        draft.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.norm.load_state_dict(target.model.norm.state_dict())
    (path / "draft").mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in draft.state_dict().items()},
              str(path / "draft" / "model.safetensors"))
    (path / "draft" / "config.json").write_text(json.dumps(draft_raw))
    return path


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_reproducing_the_target_accepts_every_token(tmp_path: Path, k: int) -> None:
    model_dir = write_oracle_pair(tmp_path / "oracle")
    prompts = [Prompt(token_ids=[5, 6, 7, 8]), image_prompt([1, 2], (1, 4, 4), [3], 4)]
    params = SamplingParams(max_new_tokens=1 + 4 * (k + 1), ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=8)).generate(prompts,
                                                                                  params)
    spec = spec_engine(model_dir, k)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert_same_logprobs(got, plain)  # every verify row committed, each under its own row
    assert spec.stats.rounds == 4 * len(prompts)
    assert spec.stats.accepted == spec.stats.drafted  # every draft token, every round
    assert spec.stats.acceptance_length == k + 1
    spec.engine.scheduler.check_no_leaks()


def test_positions_of_every_forward_follow_the_rope_index(model_dir: Path) -> None:
    """Record every forward's rows; each row's 3-D position must be its index's position under
    the prompt's rope index (checked against transformers elsewhere) or ``n + delta`` after it."""
    prompts = PROMPTS["mixed"]
    spec = spec_engine(model_dir, 3, chunk=16)
    seen: list[tuple[str, list[str], torch.Tensor, torch.Tensor]] = []
    spec.position_log = lambda *entry: seen.append(entry)
    reqs = []
    for p in prompts:
        prepared = spec.engine.prepare(p)
        reqs.append(spec.engine.add_request(prepared.token_ids, prepared.images, GREEDY))
    tables = {}
    for r, p in zip(reqs, prompts, strict=True):
        table, delta = rope_index(r.prompt_token_ids, [im.grid_thw for im in p.images], IMG, 2)
        tables[r.request_id] = (table, delta)
    while spec.engine.scheduler.has_unfinished():
        spec.step()
    phases = Counter(phase for phase, *_ in seen)
    assert set(phases) == {"prefill", "draft_prefill", "draft_decode", "verify", "draft_extend"}
    for phase, rows, pos, mrope in seen:
        assert mrope.shape == (3, len(rows)) and pos.shape == (len(rows),), phase
        for col, (rid, p) in enumerate(zip(rows, pos.tolist(), strict=True)):
            table, delta = tables[rid]
            want = table[:, p] if p < table.shape[1] else torch.full((3,), p + delta)
            assert mrope[:, col].tolist() == want.tolist(), (phase, rid, p)
    assert any(d != 0 for _, d in tables.values())


def test_worked_example_of_the_notes(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt A <vs> [6 image tokens, grid 1x4x6] <ve> B: delta -3; K = 3; round 1 accepts two
    drafts (A = 3), round 2 starts at S' = 13."""
    spec = spec_engine(model_dir, 3)
    seen: list[tuple[str, list[int], list[int]]] = []
    spec.position_log = lambda phase, rows, pos, mrope: seen.append(
        (phase, pos.tolist(), mrope[0].tolist()))
    forced = {"round": 0}
    real_accept = spec._accept

    def accept_two(reqs, drafts, q, logits):  # noqa: ANN001, ANN202
        forced["round"] += 1
        accepted, last = real_accept(reqs, drafts, q, logits)
        if forced["round"] == 1:
            return torch.tensor([2]), logits[:, 2].argmax(dim=-1)
        return accepted, last

    monkeypatch.setattr(spec, "_accept", accept_two)
    prompt = image_prompt([7], (1, 4, 6), [8], 5)
    prepared = spec.engine.prepare(prompt)
    ids, images = prepared.token_ids, prepared.images
    assert len(ids) == 10
    spec.engine.add_request(ids, images, SamplingParams(max_new_tokens=12, ignore_eos=True))
    while spec.engine.scheduler.has_unfinished():
        spec.step()
    rounds = [(ph, p, m) for ph, p, m in seen if ph in ("draft_decode", "verify", "draft_extend")]
    assert rounds[0] == ("draft_decode", [10], [7])
    assert rounds[1] == ("draft_decode", [11], [8])
    assert rounds[2] == ("verify", [10, 11, 12, 13], [7, 8, 9, 10])
    assert rounds[3] == ("draft_extend", [10, 11, 12, 13], [7, 8, 9, 10])
    assert rounds[4] == ("draft_decode", [13], [10])
    assert rounds[5] == ("draft_decode", [14], [11])
    assert rounds[6] == ("verify", [13, 14, 15, 16], [10, 11, 12, 13])


def first_token_chi2(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator,
                     trials: int = 20000) -> float:
    """Chi-square of the first token :func:`accept_sampled` commits, over ``trials`` rounds of
    two drafts sampled from ``q``, against the target's ``p[0]``."""
    first: Counter[int] = Counter()
    for _ in range(trials):
        d1 = int(torch.multinomial(q[0], 1, generator=gen))
        d2 = int(torch.multinomial(q[1], 1, generator=gen))
        first[accept_sampled([d1, d2], p, q, gen)[0]] += 1
    observed = torch.tensor([first[t] for t in range(p.shape[-1])], dtype=torch.float64)
    expected = p[0].double() * trials
    return float(((observed - expected) ** 2 / expected).sum())


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    p = torch.softmax(torch.randn(3, vocab, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)
    assert first_token_chi2(p, q, gen) < 20.5  # p = 0.0004 at 4 degrees of freedom


def test_a_seeded_request_draws_the_same_in_any_batch() -> None:
    """The batched draws of a round (draft distributions with and without filters, rejection
    sampling, one draw per row) give a seeded request the same result alone and beside other
    requests, seeded or not."""
    gen = torch.Generator().manual_seed(0)
    bsz, k, vocab = 4, 3, 7
    logits = torch.randn(bsz, k + 1, vocab, generator=gen)
    params = [SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=2),
              SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, min_p=0.1, seed=3)]
    p = row_probs(logits.flatten(0, 1), [x for x in params for _ in range(k + 1)])
    p = p.view(bsz, k + 1, vocab)
    q = torch.softmax(torch.randn(bsz, k, vocab, generator=gen), dim=-1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(bsz, k)

    def run(rows: list[int]) -> list[list[int]]:
        gens = [make_generator(params[i].seed) for i in rows]
        probs = row_probs(logits[rows, 0], [params[i] for i in rows])  # alone or together
        picked = draw(probs, gens)
        accepted, last = chain_sampled(drafts[rows], p[rows], q[rows], gens)
        return [[int(a), int(b), int(c)] for a, b, c in zip(picked, accepted, last, strict=True)]

    together = run([0, 1, 2, 3])
    for i in (0, 1, 3):  # the seeded ones
        assert run([i]) == [together[i]]
        alone = row_probs(logits[i, :1], [params[i]])
        torch.testing.assert_close(alone, row_probs(logits[:, 0], params)[i : i + 1],
                                   atol=0, rtol=0)


def test_sampling_with_eagle_runs_and_frees_everything(model_dir: Path) -> None:
    spec = spec_engine(model_dir, 3)
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16, seed=7,
                            ignore_eos=True)
    out = spec.generate(PROMPTS["mixed"], params)
    assert all(len(o.token_ids) == 16 for o in out)
    spec.engine.scheduler.check_no_leaks()


def test_padded_static_batch_equals_plain_decoding(model_dir: Path) -> None:
    """Three requests run in the buffers padded to the captured size 4: the padded row writes only
    the scratch page, which no request ever owns, and the output is unchanged."""
    prompts = [*PROMPTS["mixed"][:2], PROMPTS["text"][0]]
    plain = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(prompts,
                                                                                   GREEDY)
    spec = spec_engine(model_dir, 3)
    padded = []
    real_verify = spec.graph.verify

    def verify(rnd, ids):  # noqa: ANN001, ANN202
        hidden = real_verify(rnd, ids)
        padded.append((len(rnd.reqs), spec.graph.bs))
        assert all(spec.engine.scratch_page not in r.page_ids for r in rnd.reqs)
        return hidden

    spec.graph.verify = verify  # type: ignore[method-assign]
    got = spec.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert (3, 4) in padded
    spec.engine.scheduler.check_no_leaks()
