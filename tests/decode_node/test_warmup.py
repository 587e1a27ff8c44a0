"""Start-up capture (decode_node/warmup.py): every graph serving replays is captured before
serving, and replays of what was captured give the eager tokens.

No GPU here, so graphs are emulated: a "capture" records the forward's closure and its output
tensor, and a "replay" runs that recorded closure again into the same output. That is what a
CUDA graph does with the kernels it recorded: a forward that read anything but the static
buffers (a batch's own length, a tensor made for one call) replays with stale values, here as on
a GPU. So serving after :func:`capture_all` must capture nothing new and decode exactly as the
eager engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cli.engine_args import add_engine_args, engine_config
from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from decode_node.warmup import WarmUp, warm_up
from deploy.ray_launcher import LaunchOptions, device_args
from engine.builtin import builtin_model_dir
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt, decode_graphs_for
from engine.models.eagle.loader import load_draft
from engine.runner.cuda_graph import GraphCache

BUILTIN = builtin_model_dir()
PROMPTS = [Prompt(text=t) for t in ("import os\n", "def f(x):", "class A:\n    def",
                                    "for i in range(", "x = [", "return self.", "if not ",
                                    "    def __init__(self")]
LENGTHS = [3, 5, 7, 9, 11, 13, 15, 17]  # the batch shrinks through every padded size
SIZES = (1, 2, 4)  # with max_num_seqs 8: captured at 1, 2, 4 and 8


class _RecordedForward:
    """A CUDA graph stand-in: :meth:`replay` runs the closure recorded at capture into the
    output captured then."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def emulate_capture(cache: GraphCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``cache`` capture (and replay) on the CPU, with :class:`_RecordedForward`."""
    def capture(fn: Callable[[], torch.Tensor]) -> tuple[_RecordedForward, torch.Tensor]:
        out = fn()
        return _RecordedForward(fn, out), out

    monkeypatch.setattr(cache, "captures", True)
    monkeypatch.setattr(cache, "_capture", capture)


def config(**kw: object) -> EngineConfig:
    return EngineConfig(num_pages=256, page_size=16, max_num_seqs=8, max_model_len=256,  # type: ignore[arg-type]
                        cuda_graph_sizes=SIZES, **kw)


def params() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]


@pytest.fixture(scope="module")
def eager() -> list[list[int]]:
    engine = LLMEngine(BUILTIN, config())
    return [r.token_ids for r in engine.generate(PROMPTS, params())]


def test_decode_graphs_are_all_captured_before_serving(
        eager: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(BUILTIN, config())
    graphs = decode_graphs_for(engine, engine.runner.attn, enabled=False)
    emulate_capture(graphs.graphs, monkeypatch)
    engine.runner.decode_graphs = graphs
    assert graphs.capture_all() == ["decode:1", "decode:2", "decode:4", "decode:8"]
    assert graphs.graphs.num_captured == 4
    got = [r.token_ids for r in engine.generate(PROMPTS, params())]
    assert graphs.graphs.num_captured == 4  # serving replayed, never captured
    assert got == eager
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("shape", [TreeShape(4), TreeShape(4, 2, 3)], ids=["chain", "tree"])
def test_eagle_graphs_are_all_captured_before_serving(
        eager: list[list[int]], monkeypatch: pytest.MonkeyPatch, shape: TreeShape) -> None:
    engine = LLMEngine(BUILTIN, config(lookahead_tokens=shape.lookahead))
    draft = load_draft(BUILTIN / "draft", engine.model_config.text, torch.float32)
    spec = EagleEngine(engine, draft, shape.num_draft_tokens, shape.topk, shape.steps)
    emulate_capture(spec.graph.graphs, monkeypatch)
    names = spec.graph.capture_all(tree=not shape.is_chain)
    verify = "verify" if shape.is_chain else "verify_tree"
    assert names == [f"{kind}:{bs}" for bs in (1, 2, 4, 8) for kind in (verify, "draft_extend")]
    captured = spec.graph.graphs.num_captured
    assert captured == 8
    reqs = [engine.add_request(engine.prepare(p).token_ids, sampling=s)
            for p, s in zip(PROMPTS, params(), strict=True)]
    while engine.scheduler.has_unfinished():
        spec.step()
    assert spec.graph.graphs.num_captured == captured
    assert [r.output_token_ids for r in reqs] == eager
    assert spec.stats.accepted > 0
    engine.scheduler.check_no_leaks()


def test_a_cpu_worker_says_why_it_captures_nothing() -> None:
    report = warm_up(LLMEngine(BUILTIN, config()), None)
    assert report == WarmUp([], reason="CUDA graphs need a CUDA device; this worker runs on cpu")
    assert report.line() == ("graphs: none captured (CUDA graphs need a CUDA device; this "
                             "worker runs on cpu)")


def test_the_start_up_line_lists_what_was_captured() -> None:
    report = WarmUp(["verify:1", "draft_extend:1", "verify:2", "draft_extend:2"], 1.25, 96 << 20)
    assert report.line() == ("graphs: captured 4 (verify at 1 2; draft_extend at 1 2) in 1.2 s, "
                             "96 MiB")


def test_cuda_graph_sizes_reach_the_engine_and_the_launched_workers(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--device", "cpu", "--cuda-graph-sizes", "1", "4", "16"])
    assert engine_config(args).cuda_graph_sizes == (1, 4, 16)
    assert engine_config(parser.parse_args(["--device", "cpu"])).cuda_graph_sizes is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "0"])
    opts = LaunchOptions(model=str(tmp_path), cuda_graph_sizes=(2, 8))
    assert device_args(opts)[-3:] == ["--cuda-graph-sizes", "2", "8"]
    assert "--cuda-graph-sizes" not in device_args(LaunchOptions(model=str(tmp_path)))


def test_a_triton_that_does_not_load_falls_back_to_the_torch_attention(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A broken Triton (here: its backend module fails to import) leaves a CUDA pool on the
    reference attention, with the reason logged and given by the start-up line."""
    from types import SimpleNamespace

    from engine.attention import select
    from engine.attention.backend import TorchPagedAttention

    def broken(name: str) -> object:
        raise ImportError(f"{name}: libcuda.so.1 has no symbol cuTensorMapEncodeTiled")

    select.triton_problem.cache_clear()
    monkeypatch.setattr(select.importlib, "import_module", broken)
    try:
        cuda_pool = SimpleNamespace(device=torch.device("cuda"))
        assert select.backend_name(cuda_pool) == "torch"  # type: ignore[arg-type]
        problem = select.triton_problem()
        assert problem is not None and "Triton does not load (ImportError" in problem
        pool = LLMEngine(BUILTIN, config()).pool
        assert isinstance(select.make_attention(pool), TorchPagedAttention)
        assert not caplog.text  # a CPU pool takes the reference anyway: nothing to say
        monkeypatch.setattr(type(pool), "device", property(lambda _: torch.device("cuda")))
        with caplog.at_level("WARNING"):
            assert isinstance(select.make_attention(pool), TorchPagedAttention)
        assert "falls back to the torch reference" in caplog.text and "cuTensorMap" in caplog.text
    finally:
        select.triton_problem.cache_clear()
        select._warn_fallback.cache_clear()
