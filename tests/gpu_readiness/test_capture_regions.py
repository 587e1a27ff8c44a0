"""Every region a decode worker captures as a CUDA graph, traced without a GPU: the decode step at
every padded size, and EAGLE's verify (chain and tree) and draft-extend forwards, EAGLE-1 and
EAGLE-3, float32 and bfloat16, with the Triton attention (its launches are custom ops with a fake
implementation) and the torch one.

The trace runs each region on ``meta`` tensors: the model loaded on ``meta`` (shapes, no data),
the KV pools and static buffers there too. A region that synchronises with the host (``.item()``,
``.tolist()``, ``bool()`` of a tensor, a data-dependent shape) fails, because a ``meta`` tensor has
no value to hand over; so does one that leaves the device (a tensor made on the CPU meets the
``meta`` ones: a device mismatch). That is what breaks a CUDA graph capture, or silently bakes
one batch's values into it. The capture itself is the start-up one (:meth:`capture_all`): the
test makes the graph cache "capture" by running the region once on ``meta``, so the regions
traced are exactly those a worker would capture. The fake tensors of ``FakeTensorMode`` would
stand in for ``cuda`` tensors more closely, but this machine's CPU build of torch refuses to make
views of them ("not linked with support for cuda devices"). Tensor-parallel rank steps are not
captured (a TP forward talks to its ranks over pipes): ``test_tp_rank_steps.py`` traces them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decode_node.spec.graph_runner import SpecGraphRunner
from engine.attention.backend import AttentionBackend, TorchPagedAttention
from engine.builtin import builtin_model_dir
from engine.builtin.tiny_model import write_tiny_draft
from engine.checkpoint import load_model
from engine.config import EngineConfig
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine
from engine.models.eagle.loader import load_draft
from engine.runner.cuda_graph import GraphCache
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.draft_runner import DraftRunner
from engine.runner.model_runner import ModelRunner
from tests.gpu_readiness.on_meta import OnMeta

META = torch.device("meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_BS = 64  # the default sizes up to it: 1, 2, 4, 8, 16, 24, 32, 48, 64


def triton(pool: KVPool) -> AttentionBackend:
    from engine.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(pool)


BACKENDS: dict[str, Callable[[KVPool], AttentionBackend]] = {"triton": triton,
                                                              "torch": TorchPagedAttention}


@pytest.fixture(autouse=True)
def on_meta() -> Iterator[None]:
    """Fail an op that meets ``meta`` tensors with another device's, even where torch's
    ``meta`` kernel would not."""
    with OnMeta():
        yield


class _Traced:
    """A "graph" whose capture was a trace on ``meta``; a replay traces again."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def trace_captures(cache: GraphCache, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Make ``cache`` capture by tracing each region on ``meta``; the outputs traced."""
    outputs: list[torch.Tensor] = []

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[_Traced, torch.Tensor]:
        out = fn()
        assert out.device == META, f"a captured region returned a tensor on {out.device}"
        outputs.append(out)
        return _Traced(fn), out

    monkeypatch.setattr(cache, "captures", True)
    monkeypatch.setattr(cache, "_capture", capture)
    return outputs


def meta_engine(model_dir: Path, dtype: str, backend: str, lookahead: int = 0) -> LLMEngine:
    """An engine whose model, KV pool and attention live on ``meta`` (its scheduler and
    persistent batch stay on the host, as on a GPU worker)."""
    engine = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=16, max_num_seqs=MAX_BS,
                                               max_model_len=512, lookahead_tokens=lookahead,
                                               dtype=dtype))
    _, model = load_model(model_dir, DTYPES[dtype], META)
    p = engine.pool
    engine.model = model
    engine.pool = KVPool(p.num_pages, p.page_size, p.num_kv_heads, p.head_dim, p.layer_ids,
                         p.dtype, META)
    engine.runner = ModelRunner(model, BACKENDS[backend](engine.pool))
    return engine


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_regions_trace_at_every_size(dtype: str, backend: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = meta_engine(builtin_model_dir(), dtype, backend)
    graphs = DecodeGraphs(engine.model, engine.runner.attn, max_bs=MAX_BS, max_pages=32,
                          pad_page=engine.scratch_page, enabled=False)
    outputs = trace_captures(graphs.graphs, monkeypatch)
    assert graphs.capture_all() == [f"decode:{bs}" for bs in (1, 2, 4, 8, 16, 24, 32, 48, 64)]
    hidden = engine.model_config.text.hidden_size
    assert [tuple(o.shape) for o in outputs] == [(bs, hidden) for bs in graphs.graphs.sizes]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("eagle", ["eagle1", "eagle3"])
def test_eagle_regions_trace_at_every_size(eagle: str, tree: bool, dtype: str, backend: str,
                                           tiny_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify (a chain's, or a tree's under its mask) and draft extend; the built-in draft is
    EAGLE-3 (its features fuse three target layers, computed inside the verify region)."""
    if eagle == "eagle3":
        model_dir, draft_dir = builtin_model_dir(), builtin_model_dir() / "draft"
    else:
        model_dir, draft_dir = tiny_dir, write_tiny_draft(tmp_path / "draft")
    engine = meta_engine(model_dir, dtype, backend, lookahead=7)
    draft = load_draft(draft_dir, engine.model_config.text, DTYPES[dtype], META)
    drafter = DraftRunner(engine, draft)
    drafter.attn = BACKENDS[backend](drafter.pool)
    assert bool(drafter.aux_layers) == (eagle == "eagle3")
    runner = SpecGraphRunner(engine, drafter, 4)
    outputs = trace_captures(runner.graphs, monkeypatch)
    kind = "verify_tree" if tree else "verify"
    sizes = runner.capture_sizes
    assert runner.capture_all(tree) == [f"{name}:{bs}" for bs in sizes
                                        for name in (kind, "draft_extend")]
    assert len(outputs) == 2 * len(sizes)


def test_a_region_that_reads_the_device_fails_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: an attention that sizes its work by the batch's longest sequence
    (a host sync) is caught."""
    engine = meta_engine(builtin_model_dir(), "bfloat16", "triton")
    attn = engine.runner.attn
    prepare = type(attn).prepare

    def syncing(self: AttentionBackend, batch: object) -> None:
        int(batch.kv_lens.max())  # type: ignore[attr-defined]
        prepare(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(type(attn), "prepare", syncing)
    graphs = DecodeGraphs(engine.model, attn, max_bs=4, max_pages=8,
                          pad_page=engine.scratch_page, enabled=False)
    trace_captures(graphs.graphs, monkeypatch)
    with pytest.raises(RuntimeError, match="meta tensors"):
        graphs.capture_all()


def test_a_region_that_leaves_the_device_fails_the_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a forward that makes a tensor on the host (here its positions) is
    caught as a device mismatch."""
    engine = meta_engine(builtin_model_dir(), "bfloat16", "triton")
    graphs = DecodeGraphs(engine.model, engine.runner.attn, max_bs=4, max_pages=8,
                          pad_page=engine.scratch_page, enabled=False)
    monkeypatch.setattr(graphs, "mrope", torch.zeros(3, 4, dtype=torch.int64))
    trace_captures(graphs.graphs, monkeypatch)
    with pytest.raises(RuntimeError, match="device"):
        graphs.capture_all()
