"""EAGLE-2 draft trees: greedy output equals plain decoding at several tree shapes (text, image,
mixed batch), every tree forward's positions audited, the worked example of
docs/architecture.md, lossless sampling over a tree, and the tree's pieces (shape bounds,
drafting and rerank, acceptance, penalties, the attention mask) on hand-made numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_eagle import GREEDY, IMG, PROMPTS, assert_same_logprobs, image_prompt, write_oracle_pair

import decode_node.spec.tree_round as tree_round
from decode_node.spec.accept import Accepted, accept_tree, draw
from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import DraftTree, TreeDraft, TreeShape
from engine.attention.backend import tree_key_mask
from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.models.eagle.loader import load_draft
from engine.multimodal.mrope import rope_index
from engine.runner.cuda_graph import GraphCache
from engine.sampling.penalties import chain_scores, tree_scores

SHAPES = [(4, 2, 3), (6, 3, 2), (3, 1, 5)]  # (num_draft_tokens, topk, steps)
# root -> {1, 2}, 1 -> 3, 3 -> 4 (the worked example's tree)
EXAMPLE = DraftTree(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[-1, 0, 0, 1, 3]]),
                    torch.tensor([[0, 1, 1, 2, 3]]),
                    torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                   [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]], dtype=torch.bool))


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer target and a draft that approximates it: partial acceptance."""
    return write_oracle_pair(tmp_path_factory.mktemp("tree") / "pair", exact=False)


@pytest.fixture(scope="module")
def plain_tokens(pair_dir: Path) -> dict[str, list[list[int]]]:
    """Plain greedy decoding of every case of ``PROMPTS`` on the pair's target."""
    engine = LLMEngine(pair_dir, EngineConfig(num_pages=256, page_size=8))
    return {case: [r.token_ids for r in engine.generate(prompts, GREEDY)]
            for case, prompts in PROMPTS.items()}


def tree_engine(model_dir: Path, n: int, k: int, s: int) -> EagleEngine:
    shape = TreeShape(n, k, s)
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=shape.lookahead,
                          max_num_batched_tokens=24)
    engine = LLMEngine(model_dir, config)
    draft = load_draft(model_dir / "draft", engine.model_config.text, torch.float32)
    return EagleEngine(engine, draft, n, k, s)


def record_paths(spec: EagleEngine) -> list[list[int]]:
    """The accepted paths of every tree round of ``spec`` (node indices from the root)."""
    assert spec.trees is not None
    paths: list[list[int]] = []
    real = spec.trees._move_target_kv

    def move(rnd, p):  # noqa: ANN001, ANN202
        paths.extend(p)
        real(rnd, p)

    spec.trees._move_target_kv = move  # type: ignore[method-assign]
    return paths


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}s{}".format(*s))
@pytest.mark.parametrize("case", list(PROMPTS))
def test_tree_greedy_equals_plain_decoding(pair_dir: Path, plain_tokens: dict[str, list[list[int]]],
                                           case: str, shape: tuple[int, int, int]) -> None:
    spec = tree_engine(pair_dir, *shape)
    paths = record_paths(spec)
    got = spec.generate(PROMPTS[case], GREEDY)
    assert [g.token_ids for g in got] == plain_tokens[case]
    assert spec.stats.rounds > 0 and spec.stats.drafted == shape[0] * spec.stats.rounds
    assert spec.stats.accepted > 0
    if shape[1] > 1:  # some accepted path leaves the first branch: its target KV moved
        assert any(p != j for path in paths for j, p in enumerate(path))
    spec.engine.scheduler.check_no_leaks()


def test_tree_scores_penalize_each_node_with_its_own_path() -> None:
    """Row ``j`` of a tree's penalized verify logits is the last row of the chain made of node
    ``j``'s path (``chain_scores``, which equals the penalty rules token by token)."""
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.9, presence_penalty=0.5)
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 2.5  # [N, V]
    tokens = [7, 3, 4, 3, 7]  # root 7; parents -1, 0, 0, 1, 3: path 3 -> 3 -> 7
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 1]], dtype=torch.bool)
    req = Request("r", [1, 2, 3], params, output_token_ids=[5, 7])
    got = tree_scores(req, tokens, mask, logits)
    for j in range(5):
        path = [tokens[a] for a in range(1, j + 1) if mask[j, a]]  # node j's drafted path
        want = chain_scores(req, path, logits[j : j + 1].expand(len(path) + 1, -1))[-1]
        torch.testing.assert_close(got[j], want)
    assert tree_scores(Request("r", [1], GREEDY), tokens, mask, logits) is logits


def test_a_one_child_tree_round_is_the_chain_round(pair_dir: Path) -> None:
    """The tree machinery run on the chain's shape (k = 1, steps = n) drafts, accepts and
    commits exactly what the chain path does."""
    prompts = [PROMPTS["text"][0], *PROMPTS["image"]]
    chain = tree_engine(pair_dir, 3, 1, 3)
    assert chain.trees is None  # the chain path
    forced = tree_engine(pair_dir, 3, 1, 3)
    forced.trees = tree_round.TreeRounds(forced.engine, forced.drafter, forced.graph,
                                         forced.shape, forced._log_rows)
    want = [g.token_ids for g in chain.generate(prompts, GREEDY)]
    assert [g.token_ids for g in forced.generate(prompts, GREEDY)] == want
    assert forced.stats == chain.stats and chain.stats.accepted > 0
    forced.engine.scheduler.check_no_leaks()


def test_a_tree_verify_and_a_chain_verify_are_different_graphs(
        pair_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain round and a tree round of the same shape verify the same number of rows at the
    same padded sizes, but the tree's forward runs under its mask: their graphs are keyed
    apart, so a captured chain graph is never replayed for a tree round."""
    keys: list[tuple[str, int]] = []
    real = GraphCache.run

    def run(self: GraphCache, name: str, size: int, fn):  # noqa: ANN001, ANN202
        keys.append((name, size))
        return real(self, name, size, fn)

    monkeypatch.setattr(GraphCache, "run", run)
    chain = tree_engine(pair_dir, 3, 1, 3)
    chain.generate(PROMPTS["text"][:1], GREEDY)
    chain_keys, keys[:] = set(keys), []
    tree = tree_engine(pair_dir, 3, 1, 3)
    tree.trees = tree_round.TreeRounds(tree.engine, tree.drafter, tree.graph, tree.shape,
                                       tree._log_rows)
    tree.generate(PROMPTS["text"][:1], GREEDY)
    verify = {(name, size) for name, size in chain_keys if name.startswith("verify")}
    assert verify and {name for name, _ in verify} == {"verify"}
    assert {(name, size) for name, size in keys if name.startswith("verify")} == {
        ("verify_tree", size) for _, size in verify}


@pytest.mark.parametrize("shape", [(3, 1, 5), (6, 3, 2)], ids=["n3k1s5", "n6k3s2"])
def test_exact_draft_accepts_its_argmax_path(tmp_path: Path, shape: tuple[int, int, int]
                                             ) -> None:
    """A draft that reproduces the target. The ``k = 1`` tree keeps the first ``n`` nodes of
    its 5-deep chain, so every round commits ``n + 1`` tokens. A wider tree commits its argmax
    path whenever the rerank kept it (not always: a sibling branch may score higher)."""
    model_dir = write_oracle_pair(tmp_path / "oracle")
    prompts = [PROMPTS["text"][0], image_prompt([1, 2], (1, 4, 4), [3], 4)]
    n, k, s = shape
    length = min(n, s) + 1
    params = SamplingParams(max_new_tokens=1 + 4 * length, ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=8)).generate(prompts,
                                                                                  params)
    spec = tree_engine(model_dir, *shape)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert_same_logprobs(got, plain)  # each committed node's logprob under its own row
    if k == 1:
        assert spec.stats.rounds == 4 * len(prompts)
        assert spec.stats.acceptance_length == length
    else:
        assert spec.stats.acceptance_length > length - 0.5
    spec.engine.scheduler.check_no_leaks()


def test_positions_of_every_tree_forward(pair_dir: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """Every row's 3-D position follows the rope index (``n + delta`` past the prompt); draft
    forward ``i`` runs its rows at ``S + i - 1``, the verify node ``j`` at ``S + depth(j)``, the
    draft extend at ``S + j``."""
    n, k, s = 4, 2, 3
    prompts = PROMPTS["mixed"]
    spec = tree_engine(pair_dir, n, k, s)
    events: list[tuple] = []
    spec.position_log = lambda *entry: events.append(("log", *entry))
    real_inputs, real_select = spec.graph.round_inputs, TreeDraft.select

    def round_inputs(reqs, starts):  # noqa: ANN001, ANN202
        events.append(("round", [r.request_id for r in reqs], list(starts)))
        return real_inputs(reqs, starts)

    def select(self, num):  # noqa: ANN001, ANN202
        tree = real_select(self, num)
        events.append(("tree", tree.depths.clone()))
        return tree

    spec.graph.round_inputs = round_inputs  # type: ignore[method-assign]
    monkeypatch.setattr(TreeDraft, "select", select)
    reqs = []
    for p in prompts:
        prepared = spec.engine.prepare(p)
        reqs.append(spec.engine.add_request(prepared.token_ids, prepared.images, GREEDY))
    tables = {r.request_id: rope_index(r.prompt_token_ids, [im.grid_thw for im in p.images],
                                       IMG, 2) for r, p in zip(reqs, prompts, strict=True)}
    while spec.engine.scheduler.has_unfinished():
        spec.step()
    for ev in events:  # every row: the rope index, or n + delta past the prompt
        if ev[0] == "log":
            _, phase, rows, pos, mrope = ev
            assert mrope.shape == (3, len(rows)) and pos.shape == (len(rows),), phase
            for col, (rid, p) in enumerate(zip(rows, pos.tolist(), strict=True)):
                table, delta = tables[rid]
                want = table[:, p] if p < table.shape[1] else torch.full((3,), p + delta)
                assert mrope[:, col].tolist() == want.tolist(), (phase, rid, p)
    rounds = [i for i, ev in enumerate(events) if ev[0] == "round"]
    assert rounds
    for i in rounds:
        _, ids, starts = events[i]
        start = torch.tensor(starts)
        drafts = events[i + 1 : i + s]
        for step, (_, phase, rows, pos, _) in enumerate(drafts, start=1):
            assert phase == "draft_decode" and rows == [r for r in ids for _ in range(k)]
            assert pos.tolist() == (start + step - 1).repeat_interleave(k).tolist()
        (_, depths), (_, verify, _, vpos, _), (_, extend, _, epos, _) = events[i + s : i + s + 3]
        assert verify == "verify" and extend == "draft_extend"
        assert vpos.tolist() == (start[:, None] + depths).flatten().tolist()
        assert epos.tolist() == (start[:, None] + torch.arange(n + 1)).flatten().tolist()
    assert any(d != 0 for _, d in tables.values())


def test_worked_example_of_the_docs(pair_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/architecture.md: prompt A <vs> [6 image tokens] <ve> B (delta -3, S = 10), k = 2,
    steps 3, n = 4, tree root -> {a, b}, a -> c, c -> e; the target takes a and c (A = 3), so
    node 3's KV moves from index 13 to 12 and round 2 starts at S' = 13."""
    spec = tree_engine(pair_dir, 4, 2, 3)
    seen: list[tuple[str, list[int], list[int]]] = []
    spec.position_log = lambda phase, rows, pos, mrope: seen.append(
        (phase, pos.tolist(), mrope[0].tolist()))
    real_select, real_accept = TreeDraft.select, tree_round.accept_tree
    moves: list[tuple[list[int], list[int]]] = []
    real_move = spec.engine.runner.move_kv

    def select(self, num):  # noqa: ANN001, ANN202
        return DraftTree(real_select(self, num).tokens, EXAMPLE.parents, EXAMPLE.depths,
                         EXAMPLE.mask)

    forced: list[bool] = []

    def accept(ids, tree, target):  # noqa: ANN001, ANN202
        if not forced:  # round 1 takes a and c
            forced.append(True)
            path = torch.tensor([[0, 1, 3, 3, 3]])
            last = target[:, 3:4]
            return Accepted(torch.tensor([3]), torch.cat([ids[:, [1, 3]], last.expand(-1, 3)],
                                                         dim=1), path)
        return real_accept(ids, tree, target)

    def move(src, dst):  # noqa: ANN001, ANN202
        moves.append((src.tolist(), dst.tolist()))
        real_move(src, dst)

    monkeypatch.setattr(TreeDraft, "select", select)
    monkeypatch.setattr(tree_round, "accept_tree", accept)
    monkeypatch.setattr(spec.engine.runner, "move_kv", move)
    prepared = spec.engine.prepare(image_prompt([7], (1, 4, 6), [8], 5))
    assert len(prepared.token_ids) == 10
    req = spec.engine.add_request(prepared.token_ids, prepared.images,
                                  SamplingParams(max_new_tokens=8, ignore_eos=True))
    spec.step()  # the prefill, then round 1 in the same step
    pages = req.page_ids
    slot = [pages[i // 8] * 8 + i % 8 for i in range(16)]
    rounds = [x for x in seen if x[0] in ("draft_decode", "verify", "draft_extend")]
    assert rounds[0] == ("draft_decode", [10, 10], [7, 7])
    assert rounds[1] == ("draft_decode", [11, 11], [8, 8])
    assert rounds[2] == ("verify", [10, 11, 11, 12, 13], [7, 8, 8, 9, 10])
    assert moves == [([slot[13]], [slot[12]])]
    assert rounds[3] == ("draft_extend", [10, 11, 12, 13, 14], [7, 8, 9, 10, 11])
    assert req.num_computed_tokens == 13
    spec.step()  # round 2
    rounds = [x for x in seen if x[0] in ("draft_decode", "verify", "draft_extend")]
    assert rounds[4] == ("draft_decode", [13, 13], [10, 10])
    assert rounds[5] == ("draft_decode", [14, 14], [11, 11])


def test_tree_shape_bounds() -> None:
    assert TreeShape(3).is_chain and TreeShape(3, 1, 3).is_chain
    assert not TreeShape(3, 1, 5).is_chain and not TreeShape(4, 2, 3).is_chain
    assert TreeShape(4, 2, 3).num_candidates == 2 + 2 * 4
    assert TreeShape(3).lookahead == 3  # the chain's: num_draft_tokens
    assert TreeShape(2, 4, 3).lookahead == 7  # scratch 8 slots from S on
    for args, words in [((0,), "--num-draft-tokens must be at least 1"),
                        ((3, 0), "--draft-topk must be at least 1"),
                        ((3, 1, 0), "--draft-steps must be at least 1"),
                        ((4, 1, 3), "exceeds the 3 candidates"),
                        ((11, 2, 3), "exceeds the 10 candidates")]:
        with pytest.raises(ValueError, match=words):
            TreeShape(*args)


def test_tree_draft_keeps_the_best_nodes_as_a_tree() -> None:
    """k = 2, steps 3, n = 4, over a vocabulary of 6 (log-probabilities by hand; -9 elsewhere):
    depth 1 {3: -0.5, 1: -1.0}; under 3: {4: -0.75, 5: -2.5}, under 1: {2: -1.1, 0: -4.0};
    the frontier 4 and 2 expand to {5: -0.95, 1: -1.75} and {3: -1.15, 4: -3.1}. The best four
    are 3, 4, 5 (a path) and 1."""

    def lp(*pairs: tuple[int, float]) -> list[float]:
        row = [-9.0] * 6
        for tok, v in pairs:
            row[tok] = v
        return row

    draft = TreeDraft(torch.tensor([lp((1, -1.0), (3, -0.5))]), 2)
    assert draft.frontier_tokens.tolist() == [[3, 1]]
    parent_row = draft.expand(torch.tensor([lp((4, -0.25), (5, -2.0)), lp((2, -0.1), (0, -3.0))]))
    assert parent_row.tolist() == [[0, 1]] and draft.frontier_tokens.tolist() == [[4, 2]]
    assert draft.rows_seen.int().tolist() == [[[1, 0, 1, 0], [0, 1, 0, 1]]]
    draft.expand(torch.tensor([lp((5, -0.2), (1, -1.0)), lp((3, -0.05), (4, -2.0))]))
    assert draft.rows_seen.int().tolist() == [[[1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1]]]
    tree = draft.select(4)
    assert tree.tokens.tolist() == [[3, 1, 4, 5]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3]]
    assert tree.mask.int().tolist() == [[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                         [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]]


def accepted_paths(ids: torch.Tensor, tree: DraftTree, target: torch.Tensor
                   ) -> list[tuple[list[int], list[int]]]:
    """:func:`accept_tree` of a batch, read back: each request's path and tokens to commit."""
    acc = accept_tree(ids, tree, target)
    assert acc.path is not None
    return [(path[:a], tokens[:a]) for path, tokens, a in
            zip(acc.path.tolist(), acc.tokens.tolist(), acc.lengths.tolist(), strict=True)]


def test_greedy_tree_acceptance_follows_the_target() -> None:
    tokens = torch.tensor([[9, 3, 1, 4, 5]])

    def accept(argmax: list[int]) -> tuple[list[int], list[int]]:
        [got] = accepted_paths(tokens, EXAMPLE, torch.tensor([argmax]))
        return got

    assert accept([3, 4, 0, 7, 0]) == ([0, 1, 3], [3, 4, 7])
    assert accept([1, 0, 9, 0, 0]) == ([0, 2], [1, 9])
    assert accept([3, 4, 0, 5, 8]) == ([0, 1, 3, 4], [3, 4, 5, 8])
    assert accept([6, 0, 0, 0, 0]) == ([0], [6])
    # two siblings with the target's token (never drafted: a node's children are distinct):
    # the first in index order, as a walk from the root would take, though the second's child
    # would go deeper (root -> {1, 2}, 2 -> 3)
    twins = DraftTree(torch.tensor([[3, 3, 4]]), torch.tensor([[-1, 0, 0, 2]]),
                      torch.tensor([[0, 1, 1, 2]]),
                      torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]],
                                   dtype=torch.bool))
    assert accepted_paths(torch.tensor([[9, 3, 3, 4]]), twins, torch.tensor([[3, 0, 4, 0]])) == [
        ([0, 1], [3, 0])]


def test_tree_key_mask_admits_the_prefix_and_the_window_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    tree = torch.rand(2, 3, 4, generator=gen) > 0.5  # [B, max_q, W]
    kv_lens = torch.tensor([7, 5])
    keys = torch.arange(8).view(1, 1, 1, 8)
    got = tree_key_mask(keys, kv_lens.view(2, 1, 1, 1), tree)
    assert got.shape == (2, 1, 3, 8)
    for b in range(2):
        start = int(kv_lens[b]) - 4
        for q in range(3):
            for key in range(8):
                want = key < start or (key < kv_lens[b] and bool(tree[b, q, key - start]))
                assert bool(got[b, 0, q, key]) == want, (b, q, key)


def test_tree_sampling_keeps_the_target_distribution() -> None:
    """Root children 0 and 2, node 1 (token 0) with child 1: the first committed token follows
    the root's ``p``, and after token 0 the second follows node 1's."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 4, 8000
    p = torch.softmax(torch.randn(4, vocab, generator=gen), dim=-1)  # [N, V]
    tokens = [3, 0, 2, 1]  # parents -1, 0, 0, 1
    tree = DraftTree(torch.tensor([tokens[1:]]), torch.tensor([[-1, 0, 0, 1]]),
                     torch.tensor([[0, 1, 1, 2]]),
                     torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]],
                                  dtype=torch.bool))
    trees = DraftTree(*(t.expand(trials, *t.shape[1:]) for t in (tree.tokens, tree.parents,
                                                                 tree.depths, tree.mask)))
    target = draw(p.expand(trials, -1, -1), [gen] * trials)  # [trials, N]: a draw at each node
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for path, out in accepted_paths(torch.tensor([tokens]).expand(trials, -1), trees, target):
        assert len(path) == len(out) and out[: len(path) - 1] == [tokens[c] for c in path[1:]]
        first[out[0]] += 1
        if out[0] == 0:
            second[out[1]] += 1

    def chi2(observed: torch.Tensor, probs: torch.Tensor) -> float:
        expected = probs.double() * observed.sum()
        return float(((observed.double() - expected) ** 2 / expected).sum())

    assert chi2(first, p[0]) < 16.3  # p = 0.001 at 3 degrees of freedom
    assert chi2(second, p[1]) < 16.3


def test_sampling_with_trees_runs_and_frees_everything(pair_dir: Path) -> None:
    prompts = [PROMPTS["text"][0], *PROMPTS["image"]]
    spec = tree_engine(pair_dir, 4, 2, 3)
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, seed=7,
                            ignore_eos=True, repetition_penalty=1.2)
    out = spec.generate(prompts, params)
    assert all(len(o.token_ids) == 12 for o in out)
    assert spec.stats.rounds > 0
    spec.engine.scheduler.check_no_leaks()
    again = spec.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in out]  # seeded: reproducible
