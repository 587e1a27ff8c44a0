"""Decode steps through the static (graph) buffers: padding, scratch writes, and tokens equal to
transformers. On a CPU the static forward runs eagerly over the very buffers a CUDA graph would
be captured on, so everything but the capture itself is checked here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.backend import AttentionBatch
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt, decode_graphs_for
from engine.runner.cuda_graph import GraphCache, capture_sizes_for
from engine.runner.decode_graphs import DecodeGraphs
from tests.engine.test_generation_vs_transformers import cases, reference, text


class CountingGraphs(DecodeGraphs):
    """Counts the padded sizes it ran."""

    sizes_run: list[int]

    def run(self, *args: torch.Tensor | int) -> torch.Tensor:  # type: ignore[override]
        ids = args[0]
        assert isinstance(ids, torch.Tensor)
        self.sizes_run.append(self.graphs.padded(ids.shape[0]))
        return super().run(*args)  # type: ignore[arg-type]


def static_engine(model_dir: Path, **kw: int) -> tuple[LLMEngine, CountingGraphs]:
    engine = LLMEngine(model_dir, EngineConfig(**kw))  # type: ignore[arg-type]
    plain = decode_graphs_for(engine, engine.runner.attn, enabled=False)
    graphs = CountingGraphs.__new__(CountingGraphs)
    graphs.__dict__.update(plain.__dict__)
    graphs.sizes_run = []
    engine.runner.decode_graphs = graphs
    return engine, graphs


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes_for(5) == [1, 2, 4, 5]
    assert capture_sizes_for(300)[-1] == 300
    cache = GraphCache(torch.device("cpu"), [1, 2, 4, 8], enabled=True)
    assert not cache.captures  # only CUDA captures
    assert [cache.padded(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        cache.padded(9)
    with pytest.raises(ValueError, match="does not fit"):
        cache.padded(0)
    with pytest.raises(ValueError):
        capture_sizes_for(0)


class _AliasedGraph:
    """A captured graph stand-in whose output lies in ``out``, memory it shares with the other
    graphs of its pool (as a graph's output may lie where another keeps its temporaries)."""

    def __init__(self, out: torch.Tensor, value: float) -> None:
        self.out, self.value = out, value

    def replay(self) -> None:
        self.out.fill_(self.value)


def test_a_result_outlives_the_replay_of_another_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two graphs whose outputs share memory in their pool: what ``run`` handed out for one
    stays as it was through the other's capture and replays (it is a copy)."""
    cache = GraphCache(torch.device("cpu"), [1], enabled=True)
    cache.captures = True  # the capture path, with stand-ins for the CUDA graphs
    shared = torch.zeros(3)

    def capture(fn):  # noqa: ANN001, ANN202
        graph = _AliasedGraph(shared, float(fn()[0]))
        graph.replay()  # as _capture runs the captured graph once
        return graph, shared

    monkeypatch.setattr(cache, "_capture", capture)
    first = cache.run("a", 1, lambda: torch.full((3,), 1.0))
    assert torch.equal(cache.run("b", 1, lambda: torch.full((3,), 2.0)), torch.full((3,), 2.0))
    again = cache.run("a", 1, lambda: torch.full((3,), 1.0))  # a replay
    cache.run("b", 1, lambda: torch.full((3,), 2.0))
    assert torch.equal(first, torch.ones(3)) and torch.equal(again, torch.ones(3))
    assert cache.num_captured == 2


def test_static_decode_matches_transformers_as_the_batch_shrinks(hf_dir: Path, hf_model) -> None:  # noqa: ANN001,E501
    """Eight prompts (text and images) stop after different lengths, so decode batches of
    8, 7, ... 1 are padded to 8, 8, 8, 8, 4, 4, 2, 1 rows; every token equals transformers."""
    prompts = [*cases().values(), (text(30, 9), []), (text(2, 10), []), (text(12, 11), [])]
    lengths = [4, 6, 8, 10, 12, 14, 16, 20]
    engine, graphs = static_engine(hf_dir, num_pages=128, page_size=4, max_num_seqs=8)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    results = engine.generate([Prompt(token_ids=ids, images=ims) for ids, ims in prompts], params)
    for (ids, images), n, ours in zip(prompts, lengths, results, strict=True):
        assert ours.token_ids == reference(hf_model, ids, images)[:n]
    assert {8, 4, 2, 1} <= set(graphs.sizes_run)  # padded sizes were all exercised
    assert len(graphs.sizes_run) == max(lengths) - 1  # every decode step went through them
    engine.scheduler.check_no_leaks()


def test_padded_rows_write_only_the_scratch_page(tiny_dir: Path) -> None:
    engine, graphs = static_engine(tiny_dir, num_pages=32, page_size=4, max_num_seqs=4)
    pool = engine.pool
    before = [t.clone() for t in pool.entries()]
    # three sequences of 5, 9 and 2 keys on their own pages; padded to 4 rows
    tables = [[3, 7], [1, 2, 9], [5]]
    kv = [5, 9, 2]
    slots = torch.tensor([t[(n - 1) // 4] * 4 + (n - 1) % 4 for t, n in zip(tables, kv,
                                                                            strict=True)])
    batch = AttentionBatch.from_lists([1, 1, 1], kv, tables, slots)
    ids = torch.tensor([5, 6, 7])
    mrope = torch.tensor([kv, kv, kv]) - 1
    hidden = graphs.run(ids, mrope, batch.kv_lens, batch.max_kv, batch.page_table, slots)
    assert graphs.sizes_run == [4] and hidden.shape[0] == 3
    scratch = engine.scratch_page
    for old, new in zip(before, pool.entries(), strict=True):
        changed = (old != new).flatten(2).any(-1)  # [pages, page_size]
        pages, offsets = changed.nonzero(as_tuple=True)
        written = {(int(p), int(o)) for p, o in zip(pages, offsets, strict=True)}
        expected = {(int(s) // 4, int(s) % 4) for s in slots} | {(scratch, 0)}
        assert written <= expected and written >= {(int(s) // 4, int(s) % 4) for s in slots}
    # the real rows equal the unpadded forward over the same inputs (to rounding: a GEMM over
    # 4 rows may block its sums differently from one over 3)
    engine.runner.attn.prepare(batch)
    eager = engine.model(engine.model.embed(ids), mrope, engine.runner.attn)
    torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-5)
