"""Issue #35: an EAGLE round reads the device at most twice, chain or tree, greedy or sampled.

On a GPU every read of a device tensor by the host (``.item()``, ``.tolist()``, ``.cpu()``,
``int(t)``, ``bool(t)``, boolean-mask indexing, ``torch.nonzero``...) stalls the host until the
device has caught up. On the CPU nothing stalls, but the same calls still run: this test counts
them (:class:`SyncCounter`, a torch function mode that sees every torch call) while an
:class:`EagleEngine` on the built-in model steps through rounds that only decode (every request
past its prefill), so each counted call is one that would synchronise on a GPU. Host-side numpy
work on host values (the scheduler, the runner's persistent batch) calls none of them; host ->
device copies are not counted either (``Tensor.to`` is left alone: on the CPU a copy to "the
engine's device" and a read back to the host are the same call).
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.builtin import builtin_hybrid_model_dir, builtin_model_dir
from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.loader import load_draft

BUILTIN, HYBRID = builtin_model_dir(), builtin_hybrid_model_dir()
MAX_SYNCS_PER_ROUND = 2
ROUNDS = 4
PROMPTS = ["import os\n", "    def __init__(self", "def add(a, b):\n    return",
           "class Stack:\n    def push(self, item):\n"]
GREEDY = [SamplingParams(max_new_tokens=200, ignore_eos=True),
          SamplingParams(max_new_tokens=200, ignore_eos=True, repetition_penalty=1.3),
          SamplingParams(max_new_tokens=200, ignore_eos=True, top_logprobs=3),
          SamplingParams(max_new_tokens=200, ignore_eos=True, frequency_penalty=0.4)]
SAMPLED = [SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=0.8, seed=1),
           SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=1.0, top_k=20,
                          top_p=0.9, seed=2, top_logprobs=2),
           SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=1.0),  # global RNG
           SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=0.9, min_p=0.05,
                          presence_penalty=0.5, seed=3)]
SHAPES = {"chain": TreeShape(4), "tree": TreeShape(4, 2, 3)}
MTP_K = 3  # the hybrid sibling's MTP chain (its verify keeps the accepted rows' states)

# torch functions and tensor methods that read a tensor's values on the host
READS = frozenset({"item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__",
                   "__float__", "__index__", "nonzero", "argwhere", "masked_select", "unique",
                   "equal", "allclose"})
MASKED = frozenset({"__getitem__", "__setitem__"})  # reads when the index is a boolean tensor

pytestmark = pytest.mark.skipif(not (BUILTIN / "config.json").is_file(),
                                reason="the built-in model is not shipped in this checkout")


class SyncCounter(TorchFunctionMode):
    """While entered, the call sites of every host read of a tensor (:data:`READS`, boolean-mask
    indexing, one-argument ``torch.where``), seen through torch's function-mode hook, so no
    class is patched; a read inside another is not seen again. What ``.cpu()`` returns is a
    host copy (a fresh tensor, even on the CPU): reading it is free, as it is on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # host copies, by id

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        name = getattr(func, "__name__", "")
        reads = _reads(name, args) and not self._on_host(args[0])
        if reads:
            self.sites.append(f"{name} at {_caller()}")
        out = func(*args, **(kwargs or {}))
        if reads and name == "cpu":
            out = out.clone() if out is args[0] else out
            self._host[id(out)] = weakref.ref(out)
        return out

    def _on_host(self, t: object) -> bool:
        """Whether ``t`` is a host copy made by a counted ``.cpu()``."""
        ref = self._host.get(id(t))
        return ref is not None and ref() is t


def _reads(name: str, args: tuple[Any, ...]) -> bool:
    """Whether a call of ``name`` on ``args`` reads a tensor on the host."""
    if name in READS:
        return True
    if name == "where":
        return len(args) == 1  # torch.where(condition): the indices of its true entries
    if name in MASKED:
        parts = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


def _caller() -> str:
    """The innermost frame outside torch and this file: the call site of a read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith(__file__):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "?"


def spec_engine(kind: str) -> EagleEngine:
    """EAGLE rounds on the built-in model in a shape of :data:`SHAPES`, or (``mtp``) on its
    hybrid sibling with its MTP head."""
    if kind == "mtp":
        if not (HYBRID / "config.json").is_file():
            pytest.skip("the built-in hybrid model is not shipped in this checkout")
        config = EngineConfig(num_pages=256, page_size=16, lookahead_tokens=MTP_K)
        engine = LLMEngine(HYBRID, config, draft="mtp")
        return EagleEngine(engine, engine.load_draft(), MTP_K)
    shape = SHAPES[kind]
    config = EngineConfig(num_pages=256, page_size=16, lookahead_tokens=shape.lookahead)
    engine = LLMEngine(BUILTIN, config)
    draft = load_draft(BUILTIN / "draft", engine.model_config.text, torch.float32)
    return EagleEngine(engine, draft, shape.num_draft_tokens, shape.topk, shape.steps)


def past_prefill(spec: EagleEngine, params: list[SamplingParams]) -> list[Request]:
    """Requests of :data:`PROMPTS` with ``params``, stepped until every one decodes in rounds."""
    reqs = []
    for text, p in zip(PROMPTS, params, strict=True):
        prepared = spec.engine.prepare(Prompt(text=text))
        reqs.append(spec.engine.add_request(prepared.token_ids, prepared.images, p))
    while not all(r.request_id in spec.states for r in reqs):
        spec.step()
    return reqs


@pytest.mark.parametrize("kind", [*SHAPES, "mtp"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_round_reads_the_device_at_most_twice(kind: str, sampling: str) -> None:
    """Greedy requests (penalties and top_logprobs among them), or sampled ones (seeded and
    not, filters, a penalty, top_logprobs; one greedy request beside them): each decode-only
    step runs one round of the whole batch (a chain, a tree, or a hybrid model's MTP chain)
    and reads the device at most twice."""
    spec = spec_engine(kind)
    params = GREEDY if sampling == "greedy" else [*SAMPLED[:3], GREEDY[0]]
    reqs = past_prefill(spec, params)
    for _ in range(ROUNDS):
        rounds, before = spec.stats.rounds, [r.num_output_tokens for r in reqs]
        with SyncCounter() as counter:
            spec.step()
        assert spec.stats.rounds == rounds + len(reqs)  # one round of each request
        assert all(r.num_output_tokens > n for r, n in zip(reqs, before, strict=True))
        assert len(counter.sites) <= MAX_SYNCS_PER_ROUND, "\n".join(counter.sites)
    asking = [r for r in reqs if r.sampling.top_logprobs]
    assert all(len(r.output_top_logprobs) == r.num_output_tokens for r in asking)


def test_the_counter_sees_each_kind_of_read() -> None:
    """Every kind of read counts once, and device work that reads nothing counts nothing."""
    t = torch.arange(6)
    with SyncCounter() as quiet:
        (t * 2).sum().argmax()
        t[torch.tensor([0, 2])]
        t[1:3] = 0
        torch.where(t > 2, t, 0)
    assert quiet.sites == []
    with SyncCounter() as counter:
        t.tolist()
        t[0].item()
        int(t[1])
        float(t[2])
        bool(t[3])
        [0, 1][t[0]]
        host = t.cpu()
        host.numpy(), host.tolist()  # the host copy's own values: no more reads
        t[t > 2]
        t[t > 2] = 1
        torch.nonzero(t)
        torch.where(t > 0)
    assert [s.split(" at ")[0] for s in counter.sites] == [
        "tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "__getitem__",
        "__setitem__", "nonzero", "where"]
    assert host is not t  # a copy even on the CPU, as a GPU's would be
