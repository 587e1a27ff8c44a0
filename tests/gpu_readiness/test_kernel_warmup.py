"""The start-up warm-up (:mod:`engine.runner.kernel_warmup`) launches every Triton kernel
specialisation serving then launches, so nothing compiles on the serving thread.

Triton runs in its interpreter here (``TRITON_INTERPRET=1``, set before ``triton`` is imported,
as in ``tests/engine/attention/test_attention_triton.py``), with the engine's attention swapped
for the Triton backend. Each launch of a paged-attention kernel is recorded by the key Triton
compiles it under: the kernel, its constexprs, the launch options, and each other argument as
Triton's own ``native_specialize_impl`` specialises it (type, 1, multiple of 16, a tensor's
16-byte alignment; ``do_not_specialize`` honoured). A warm-up, then a serving workload (prompts
of many lengths in chunks, decode batches of 18, 16, 2 and 1, EAGLE tree rounds): every key
serving launches was launched by the warm-up. A plan without its decode batches misses keys,
which shows the check can fail. The warm-up leaves no trace: outputs equal a fresh engine's and
no page or slot is held (a hybrid model's state slot included).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("needs TRITON_INTERPRET=1 to run Triton on CPU", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

import engine.attention.kernels.paged_attention as pa  # noqa: E402
from decode_node.spec.eagle_engine import EagleEngine  # noqa: E402
from decode_node.spec.tree import TreeShape  # noqa: E402
from decode_node.warmup import tree_forwards  # noqa: E402
from engine.attention.triton_backend import TritonPagedAttention  # noqa: E402
from engine.builtin import builtin_hybrid_model_dir  # noqa: E402
from engine.builtin.tiny_model import write_tiny_draft  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402
from engine.llm_engine import LLMEngine, Prompt  # noqa: E402
from engine.models.eagle.loader import load_draft  # noqa: E402
from engine.runner.kernel_warmup import (  # noqa: E402
    KernelWarmUp,
    WarmForward,
    run_plan,
    warm_kernels,
    warm_plan,
)

KERNELS = ("_extend_kernel", "_decode_kernel", "_merge_kernel")
MAX_SPLITS = 4  # split-K factors 4 (up to 16 sequences), 3 (17-21), 2 (22-24): few programs
Key = tuple[Any, ...]


def launch_key(name: str, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """What Triton compiles this launch under (see the module docstring)."""
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    frozen = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    parts: list[Any] = [name]
    for arg, value in sorted(bound.items()):
        if arg in params and params[arg].annotation in (tl.constexpr, "tl.constexpr"):
            parts.append((arg, value))
        elif arg in params:
            parts.append((arg, native_specialize_impl(BaseBackend, value, False,
                                                      arg not in frozen, arg not in unaligned)))
        else:  # a launch option: num_warps, num_stages
            parts.append((arg, value))
    return tuple(parts)


class _Recorder:
    """Stands in for a kernel: ``[grid](...)`` records the launch's key, then launches."""

    def __init__(self, name: str, kernel: Any, keys: set[Key]) -> None:
        self.name, self.kernel, self.keys = name, kernel, keys

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.keys.add(launch_key(self.name, self.kernel, args, kwargs))
            return launch(*args, **kwargs)

        return run


@contextmanager
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[Key]]:
    """The keys launched inside the block."""
    keys: set[Key] = set()
    with monkeypatch.context() as m:
        for name in KERNELS:
            m.setattr(pa, name, _Recorder(name, getattr(pa, name), keys))
        yield keys


@pytest.fixture
def triton_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines and drafts built from here on attend through the Triton kernels."""

    def make(pool: KVPool) -> TritonPagedAttention:
        return TritonPagedAttention(pool, max_splits=MAX_SPLITS)

    monkeypatch.setattr("engine.llm_engine.make_attention", make)
    monkeypatch.setattr("engine.runner.draft_runner.make_attention", make)


def engine_for(model_dir: Path, **overrides: Any) -> LLMEngine:
    config = {"num_pages": 96, "page_size": 8, "max_num_seqs": 24,
              "max_num_batched_tokens": 64, "enable_prefix_cache": False} | overrides
    return LLMEngine(model_dir, EngineConfig(**config))


def serve(engine: LLMEngine) -> None:
    """Prompts of 1 to 150 tokens, chunked by the 64-token budget, next to decodes; then 18
    prompts whose decodes run at batch sizes 18, 16, 2 and 1 (split counts 3 and 4; the
    sizes' classes: neither, a multiple of 16, 1)."""
    lengths = (1, 3, 9, 17, 33, 70, 150)
    engine.generate([Prompt(token_ids=[5 + i] * n) for i, n in enumerate(lengths)],
                    SamplingParams(max_new_tokens=3, ignore_eos=True))
    for i, new in enumerate([2] * 2 + [3] * 14 + [4, 5]):
        engine.add_request([7, 8, i + 1], sampling=SamplingParams(max_new_tokens=new,
                                                                     ignore_eos=True))
    while engine.scheduler.has_unfinished():
        engine.step()
    engine.scheduler.check_no_leaks()


@pytest.mark.usefixtures("triton_attention")
def test_serving_launches_nothing_the_warm_up_did_not(tiny_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(tiny_dir)
    plan = warm_plan(engine)
    per_forward: dict[WarmForward, set[Key]] = {}
    for fwd in plan:
        with recording(monkeypatch) as keys:
            run_plan(engine, [fwd])
        per_forward[fwd] = keys
    warmed = set().union(*per_forward.values())
    with recording(monkeypatch) as served:
        serve(engine)
    splits = {dict(k[1:])["NUM_SPLITS"] for k in served if k[0] == "_decode_kernel"}
    assert splits == {3, 4}  # the workload reaches two split counts
    assert served <= warmed, sorted(served - warmed)
    # the check can fail: a plan without its decode batches leaves serving's decodes cold
    without = set().union(*(k for f, k in per_forward.items() if f.q_len > 1))
    assert served - without


@pytest.mark.usefixtures("triton_attention")
def test_tree_rounds_launch_nothing_the_warm_up_did_not(tiny_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft tree's masked forwards (one window per depth) and its verify, eager here as
    on a tensor-parallel GPU worker; the draft's layer attends like the target's."""
    shape = TreeShape(5, 2, 3)
    engine = engine_for(tiny_dir, lookahead_tokens=shape.lookahead, max_num_seqs=4)
    draft = load_draft(write_tiny_draft(tmp_path / "draft"), engine.model_config.text,
                       torch.float32)
    spec = EagleEngine(engine, draft, shape.num_draft_tokens, shape.topk, shape.depth)
    trees = tree_forwards(shape)
    with recording(monkeypatch) as warmed:
        run_plan(engine, warm_plan(engine, trees))
    with recording(monkeypatch) as served:
        spec.generate([Prompt(token_ids=[3, 4, 5, 6] * 5), Prompt(token_ids=[9, 10])],
                      SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.scheduler.check_no_leaks()
    assert any(dict(k[1:]).get("TREE") for k in served)
    assert served <= warmed, sorted(served - warmed)
    with recording(monkeypatch) as untreed:
        run_plan(engine, warm_plan(engine))
    assert served - untreed  # the check can fail: without the trees' forwards


def test_warm_up_leaves_no_trace_in_a_hybrid_engine() -> None:
    """The warm-up writes the scratch page and state slot 0 only: afterwards a hybrid engine
    (its requests starting in slot 0) decodes exactly as a fresh one, holding nothing."""
    prompts = [Prompt(token_ids=list(range(3, 40))), Prompt(token_ids=[11, 12, 13])]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    fresh = engine_for(builtin_hybrid_model_dir()).generate(prompts, params)
    warmed = engine_for(builtin_hybrid_model_dir())
    assert warmed.states is not None
    run_plan(warmed, warm_plan(warmed))
    assert warmed.states.pool.conv(0)[0].abs().sum() > 0  # slot 0 was written
    assert [r.token_ids for r in warmed.generate(prompts, params)] == [
        r.token_ids for r in fresh]
    warmed.scheduler.check_no_leaks()


def test_plan_and_start_up_line(tiny_dir: Path) -> None:
    engine = engine_for(tiny_dir)
    plan = warm_plan(engine, [(2, 2), (2, 4), (2, 2)])
    assert [f.q_len for f in plan if f.num_seqs == 1 and not f.window][:7] == [
        2, 4, 8, 16, 32, 64, 128]
    decodes = [f.num_seqs for f in plan if f.q_len == 1]
    assert decodes == sorted(set(decodes)) and {1, 2, 16} <= set(decodes)
    assert max(decodes) <= 24
    assert [(f.q_len, f.window) for f in plan if f.window] == [(2, 2), (2, 4)]
    assert warm_kernels(engine).line() == "kernels: not warmed (nothing to compile on cpu)"
    assert KernelWarmUp(20, 3.24, 2, 5 << 20).line() == (
        "kernels: compiled by 20 warm-up forwards, 2 under a tree mask in 3.2 s, 5 MiB")
    assert tree_forwards(TreeShape(3)) == []  # a chain's forwards are causal
    assert tree_forwards(TreeShape(5, 2, 3)) == [(2, 2), (2, 4), (6, 6)]
