"""Tensor-parallel rank steps, traced without a GPU for a group of two: rank 1's target forwards
(a prefill chunk, a decode batch, an EAGLE verify window), its share of an EAGLE draft's layer
(:attr:`Command.DRAFT`: the draft prefill and the draft extend, EAGLE-1 and EAGLE-3) and its KV
moves (:attr:`Command.MOVE_KV`), a hybrid (Qwen3.5-shaped) model's forwards with their
:class:`StateStep` (fresh, restored and saved state slots, a verify window's) and its
:attr:`Command.KEEP_STATES` and MTP layer, and rank 0's side of the same steps; float32 and
bfloat16, the Triton attention (its launches are custom ops with a fake implementation) and the
torch one.

As in ``test_capture_regions.py`` every tensor is on ``meta``. Rank 0 is an engine whose model
share (built with the group), KV pool, state pool and attention live there (its scheduler and
persistent batch on the host), driving the real runner, draft runner and verify runner. Its
peers are a :class:`TPDriver` with no process: what it would send on the pipe is kept, and its
group's collectives only check their tensor and record it. Each message is then handed to
rank 1's :func:`run_command` (the body of its serve loop) over rank 1's shares, built as a rank
builds them (:func:`_build`, :func:`_build_draft`) on ``meta``. So the steps traced are those
rank 0 announces, and rank 1 must make the collectives rank 0 makes, in order, shape for shape.

A rank step is not captured as a CUDA graph (a TP forward talks to its ranks over pipes), so it
may read the host where its code needs to (a state step's slots travel as host integers); what
it may not do is leave the device. A tensor made on the CPU that reaches a collective fails (the
trace group refuses it, naming the collective); one that meets the ``meta`` tensors in an op
fails too: torch's device check, and :class:`OnMeta` for the ops whose ``meta`` kernels skip it
(a matmul with a CPU weight returns a ``meta`` tensor). Not traced: the torch attention over a
batch of unequal chunks (it counts the real rows, which ``meta`` cannot; the traced prefills are
uniform) and a hybrid verify kept with ``verify_states="replay"`` (its replay loops to the
longest accepted count, read from the device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from decode_node.spec.graph_runner import RoundInputs, SpecGraphRunner
from engine.attention.backend import AttentionBackend, TorchPagedAttention
from engine.builtin import builtin_hybrid_model_dir, builtin_model_dir
from engine.builtin.tiny_model import write_tiny_draft
from engine.checkpoint import load_model
from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine, hybrid_states
from engine.models.eagle.loader import MTP_DRAFT, load_draft
from engine.parallel.driver import TPDriver
from engine.parallel.group import DistGroup
from engine.parallel.messages import Command, StateStep, read_step_message
from engine.parallel.rank import RankShares, RankSpec, _build, _build_draft, _layers, run_command
from engine.parallel.shard import TextShard
from engine.runner.draft_runner import DraftRunner
from engine.runner.model_runner import ModelRunner
from tests.gpu_readiness.on_meta import OnMeta

META = torch.device("meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
K = 3  # draft tokens of a chain: a verify window of N = K + 1 rows a sequence
PROMPT = 20  # tokens of each prompt: one uniform prefill chunk of the sequences together


def triton(pool: KVPool) -> AttentionBackend:
    from engine.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(pool)


BACKENDS: dict[str, Callable[[KVPool], AttentionBackend]] = {"triton": triton,
                                                              "torch": TorchPagedAttention}

Sent = tuple[str, tuple[int, ...], torch.dtype]  # a collective, its tensor's shape and dtype


@pytest.fixture(autouse=True)
def on_meta() -> Iterator[None]:
    with OnMeta():
        yield


class TraceGroup(DistGroup):
    """Rank ``rank`` of a group of two that never joins (a :class:`DistGroup`, as a rank and
    rank 0's driver hold): a collective checks that its tensor is on ``meta``, a
    ``RuntimeError`` naming the collective otherwise, and records it in :attr:`sent`."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, 2)
        self.sent: list[Sent] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._record("all_reduce", x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self._record("broadcast", x)

    def _record(self, op: str, x: torch.Tensor) -> torch.Tensor:
        if x.device != META:
            raise RuntimeError(f"rank {self.rank}'s {op} was given a tensor on {x.device}: a "
                               "tensor-parallel step left the device")
        self.sent.append((op, tuple(x.shape), x.dtype))
        return x


class TraceDriver(TPDriver):
    """Rank 0's driver of rank 1 with no process: what it would send on the pipe is kept in
    :attr:`messages`, its collectives go to a :class:`TraceGroup`."""

    def __init__(self, group: TraceGroup) -> None:  # no super().__init__: it starts processes
        self.group = group
        self.failed = self._closed = False
        self.payloads = []
        self._procs, self._conns = [], []
        self.messages: list[bytes] = []

    def _announce(self, data: bytes) -> None:
        self.messages.append(data)


class Ranks:
    """Rank 0 (a ``meta`` engine driving a :class:`TraceDriver`) and rank 1 (its shares on
    ``meta``) of ``model_dir`` with the draft ``draft``; :meth:`replay` runs on rank 1 what
    rank 0 announced."""

    def __init__(self, model_dir: Path, dtype: str, backend: str, draft: Path | str,
                 **config: Any) -> None:  # noqa: ANN401
        self.engine = engine = LLMEngine(
            model_dir, EngineConfig(num_pages=64, page_size=16, max_num_seqs=8, max_model_len=512,
                                    lookahead_tokens=K + 1, dtype=dtype, **config), draft=draft)
        self.dtype, self.backend = dtype, backend
        self.group0, self.group1 = TraceGroup(0), TraceGroup(1)
        text, torch_dtype = engine.model_config.text, DTYPES[dtype]
        shard = TextShard.of(text, 0, 2)
        _, model = load_model(model_dir, torch_dtype, META, tp=self.group0)
        p = engine.pool
        engine.model = model
        engine.pool = KVPool(p.num_pages, p.page_size, shard.num_kv_heads, p.head_dim,
                             p.layer_ids, p.dtype, META)
        engine.states = hybrid_states(text, range(text.num_hidden_layers),
                                      engine.config.state_pool_slots, torch_dtype, META, shard,
                                      verify_states=engine.config.verify_states)
        engine.tp = self.driver = TraceDriver(self.group0)
        engine.runner = ModelRunner(model, BACKENDS[backend](engine.pool))
        engine.runner.peers = self.driver
        engine.runner.states = engine.states
        # rank 1, built as rank_main builds it: rank 0's config, its page count, its draft
        assert engine.draft_dir is not None
        spec = RankSpec(str(model_dir), replace(engine.config, tp_size=2), 1, 0, 1,
                        draft=str(engine.draft_dir))
        model1, pool1, states1 = _build(spec, self.group1, META)
        draft1 = _build_draft(spec, model1, pool1, self.group1, META)
        assert draft1 is not None
        draft1.attn = BACKENDS[backend](draft1.pool)
        self.shares = RankShares(model1, _layers(spec), BACKENDS[backend](pool1), draft1, states1)

    def drafter(self) -> DraftRunner:
        """Rank 0's draft runner: its share of the engine's draft (:meth:`LLMEngine.load_draft`
        on ``meta``), announcing each draft forward to rank 1."""
        engine = self.engine
        assert engine.draft_dir is not None
        draft = load_draft(engine.draft_dir, engine.model_config.text, engine.model.dtype, META,
                           tp=engine.model.tp)
        drafter = DraftRunner(engine, draft)
        drafter.attn = BACKENDS[self.backend](drafter.pool)
        return drafter

    def add(self, *prompts: int) -> list[Request]:
        """Requests of the prompts numbered ``prompts`` (equal numbers: equal prompts)."""
        vocab = self.engine.model_config.text.vocab_size - 16  # below the special tokens
        return [self.engine.add_request([(7 * i + t) % vocab + 1 for t in range(PROMPT)],
                                        sampling=SamplingParams(max_new_tokens=32,
                                                                ignore_eos=True))
                for i in prompts]

    def step(self) -> SchedulerOutput:
        """One scheduled target forward on rank 0; every sampled token is 5 (none is sampled:
        the logits are on ``meta``)."""
        out = self.engine.scheduler.schedule()
        fwd = self.engine.runner.run(out)
        assert fwd.hidden.device == META
        self.engine.scheduler.update(out, [(5, 0.0)] * out.num_samples,
                                     [None] * out.num_samples)
        return out

    def verify_round(self, drafter: DraftRunner, reqs: list[Request]
                     ) -> tuple[SpecGraphRunner, RoundInputs, torch.Tensor, torch.Tensor]:
        """A chain's verify window over ``reqs`` (each given the pages of its window): the verify
        runner, the round's inputs, the window's token ids and the features of the verify."""
        graph = SpecGraphRunner(self.engine, drafter, K)
        starts = [r.num_computed_tokens for r in reqs]
        for r, s in zip(reqs, starts, strict=True):
            self.engine.scheduler.grow(r, s + K + 1)
        rnd = graph.round_inputs(reqs, starts)
        ids = torch.zeros(len(reqs) * (K + 1), dtype=torch.int64, device=META)
        hidden, features = graph.verify(rnd, ids)
        assert hidden.device == features.device == META
        return graph, rnd, ids, features

    def states(self) -> StateStep | None:
        """The state step of the one message rank 0 announced since the last replay."""
        [message] = self.driver.messages
        return read_step_message(message)[1]

    def replay(self) -> list[Command]:
        """Run on rank 1 the messages rank 0 announced since the last replay, and check that
        rank 1 made rank 0's collectives; the messages' commands."""
        commands = []
        for message in self.driver.messages:
            header, states = read_step_message(message)
            run_command(self.shares, header, states, self.group1, META)
            commands.append(header.command)
        self.driver.messages.clear()
        assert self.group1.sent == self.group0.sent
        self.group0.sent.clear()
        self.group1.sent.clear()
        return commands

    def forward(self, rows: int, seqs: int, pages: int, width: int = 1,
                layers: int | None = None) -> list[Sent]:
        """A forward's collectives over ``rows`` of ``seqs`` sequences whose page table has
        ``pages`` columns: its integers (mrope, slots, lengths, row starts, table) and its input
        rows (``width`` hidden sizes wide) broadcast, then one all-reduce for the attention of
        each of ``layers`` layers (every decoder layer when None) and one for its MLP."""
        text, dtype = self.engine.model_config.text, DTYPES[self.dtype]
        layers = text.num_hidden_layers if layers is None else layers
        ints = 4 * rows + 3 * seqs + 1 + seqs * pages
        return ([("broadcast", (ints,), torch.int64),
                 ("broadcast", (rows, width * text.hidden_size), dtype)]
                + [("all_reduce", (rows, text.hidden_size), dtype)] * (2 * layers))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_target_steps_trace(dtype: str, backend: str) -> None:
    """Rank 1's target forward over a prefill chunk, a decode batch and a chain's verify window
    (the built-in model beside its EAGLE-3 draft, so rank 0's verify also returns three layers'
    outputs), as rank 0 announced each: two broadcasts, then two all-reduces per layer."""
    ranks = Ranks(builtin_model_dir(), dtype, backend, builtin_model_dir() / "draft")
    drafter = ranks.drafter()
    reqs = ranks.add(0, 1)

    out = ranks.step()
    assert [(it.start, it.num_tokens) for it in out.items] == [(0, PROMPT)] * 2
    assert ranks.group0.sent == ranks.forward(2 * PROMPT, 2, 2)
    assert ranks.replay() == [Command.FORWARD]

    out = ranks.step()
    assert [(it.start, it.num_tokens) for it in out.items] == [(PROMPT, 1)] * 2
    assert ranks.group0.sent == ranks.forward(2, 2, 2)
    assert ranks.replay() == [Command.FORWARD]

    graph, *_ = ranks.verify_round(drafter, reqs)
    # a verify's page table is its static buffer: as many columns as the longest request needs
    assert ranks.group0.sent == ranks.forward(2 * (K + 1), 2, graph.max_pages)
    assert ranks.replay() == [Command.FORWARD]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eagle", ["eagle1", "eagle3"])
def test_rank_draft_steps_and_kv_moves_trace(eagle: str, backend: str, tiny_dir: Path,
                                             tmp_path: Path) -> None:
    """Rank 1's share of the draft's layer (:attr:`Command.DRAFT`) over the draft prefill and a
    chain's draft extend, and a KV move (:attr:`Command.MOVE_KV`, a draft tree's accepted path),
    in bfloat16: the built-in EAGLE-3 draft and an EAGLE-1 one."""
    if eagle == "eagle3":
        model_dir, draft_dir = builtin_model_dir(), builtin_model_dir() / "draft"
    else:
        model_dir, draft_dir = tiny_dir, write_tiny_draft(tmp_path / "draft")
    ranks = Ranks(model_dir, "bfloat16", backend, draft_dir)
    engine = ranks.engine
    drafter = ranks.drafter()
    assert bool(drafter.aux_layers) == (eagle == "eagle3")
    reqs = ranks.add(0, 1)

    out = engine.scheduler.schedule()
    fwd = engine.runner.run(out)
    samples = [(5, 0.0)] * out.num_samples
    seeds = drafter.prefill(out, samples, fwd)  # the draft over the chunk's rows
    assert {s.device for s in seeds.values()} == {META}
    engine.scheduler.update(out, samples, [None] * out.num_samples)
    # the draft's one layer over its input rows: EAGLE-1's fc of [embedding, feature], EAGLE-3's
    # pair itself (two hidden sizes wide)
    width = 2 if eagle == "eagle3" else 1
    draft_prefill = ranks.forward(2 * PROMPT, 2, 2, width=width, layers=1)
    assert ranks.group0.sent == ranks.forward(2 * PROMPT, 2, 2) + draft_prefill
    assert ranks.replay() == [Command.FORWARD, Command.DRAFT]

    graph, rnd, ids, features = ranks.verify_round(drafter, reqs)
    assert ranks.replay() == [Command.FORWARD]
    graph.draft_extend(rnd, ids, features, [1, 2])
    assert ranks.group0.sent == ranks.forward(2 * (K + 1), 2, graph.max_pages, width=width,
                                              layers=1)
    assert ranks.replay() == [Command.DRAFT]

    src = torch.arange(3, dtype=torch.int64, device=META)
    engine.runner.move_kv(src, src + 16)
    assert ranks.group0.sent == [("broadcast", (6,), torch.int64)]  # src | dst
    assert ranks.replay() == [Command.MOVE_KV]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_rank_steps_trace_with_their_state_steps(
        dtype: str, backend: str) -> None:
    """The built-in hybrid model (Gated DeltaNet and gated full-attention layers, one all-reduce
    for each's attention and one for its MLP) with its MTP draft and a state checkpoint every
    page: rank 1 applies each forward's :class:`StateStep` to its own state pool (fresh slots
    zeroed and checkpoints saved at the first chunks, a checkpoint restored for a prefix hit,
    a decode's slots, a verify window's), keeps the accepted states on
    :attr:`Command.KEEP_STATES` and runs its share of the MTP layer."""
    ranks = Ranks(builtin_hybrid_model_dir(), dtype, backend, MTP_DRAFT,
                  state_checkpoint_interval=16)
    engine, states1 = ranks.engine, ranks.shares.states
    assert states1 is not None and engine.states is not None
    assert states1.pool.layers == engine.states.pool.layers
    drafter = ranks.drafter()
    reqs = ranks.add(0, 1)

    out = ranks.step()  # the first chunks end at the checkpoint boundary
    assert [(it.start, it.num_tokens) for it in out.items] == [(0, 16)] * 2
    step = ranks.states()
    assert step is not None and step.fresh == step.slots and len(step.save) == 4
    assert ranks.group0.sent == ranks.forward(2 * 16, 2, 1)
    assert ranks.replay() == [Command.FORWARD]

    reqs += ranks.add(0)  # the first prompt again: a prefix hit up to its checkpoint
    out = ranks.step()
    assert [(it.start, it.num_tokens) for it in out.items] == [(16, PROMPT - 16)] * 3
    step = ranks.states()
    assert step is not None and not step.fresh and step.restore[1] == reqs[2].state_slot
    assert ranks.group0.sent == ranks.forward(3 * (PROMPT - 16), 3, 2)
    assert ranks.replay() == [Command.FORWARD]

    out = ranks.step()
    assert [(it.start, it.num_tokens) for it in out.items] == [(PROMPT, 1)] * 3
    assert ranks.group0.sent == ranks.forward(3, 3, 2)
    assert ranks.replay() == [Command.FORWARD]

    graph, rnd, ids, features = ranks.verify_round(drafter, reqs)
    step = ranks.states()
    assert step is not None and step.window == K + 1 and len(step.slots) == graph.bs == 4
    # three sequences padded to a captured batch size, four
    assert ranks.group0.sent == ranks.forward(4 * (K + 1), 4, graph.max_pages)
    assert ranks.replay() == [Command.FORWARD]
    assert states1.window == K + 1  # rank 1 holds the window's states
    graph.keep_states([1, 4, 2])
    assert ranks.group0.sent == [("broadcast", (3,), torch.int64)]  # the accepted counts
    assert ranks.replay() == [Command.KEEP_STATES]
    assert states1.window == 0  # kept, and the window's states dropped

    graph.draft_extend(rnd, ids, features, [0, 3, 1])  # the MTP layer: its input is H wide
    assert ranks.group0.sent == ranks.forward(4 * (K + 1), 4, graph.max_pages, layers=1)
    assert ranks.replay() == [Command.DRAFT]


def test_a_rank_step_that_leaves_the_device_fails_the_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a rank step that makes a tensor on the host (here its positions) is
    caught as a device mismatch."""
    import engine.parallel.rank as rank

    ranks = Ranks(builtin_model_dir(), "bfloat16", "triton", builtin_model_dir() / "draft")
    ranks.add(0)
    ranks.step()
    unpack = rank.unpack_step

    def on_the_host(*args: Any) -> tuple[torch.Tensor, Any]:  # noqa: ANN401
        mrope, batch = unpack(*args)
        return torch.zeros(mrope.shape, dtype=torch.int64), batch

    monkeypatch.setattr(rank, "unpack_step", on_the_host)
    with pytest.raises(RuntimeError, match="device"):
        ranks.replay()


def test_a_collective_given_a_host_tensor_fails_the_trace() -> None:
    """The check can fail: a rank step whose tensors are made on the CPU reaches its first
    collective with one, which the trace group refuses, naming it."""
    ranks = Ranks(builtin_model_dir(), "bfloat16", "triton", builtin_model_dir() / "draft")
    ranks.add(0)
    ranks.step()
    header, states = read_step_message(ranks.driver.messages[0])
    with pytest.raises(RuntimeError, match="rank 1's broadcast was given a tensor on cpu"):
        run_command(ranks.shares, header, states, ranks.group1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="rank 0's all_reduce was given a tensor on cpu"):
        ranks.group0.all_reduce(torch.zeros(2, ranks.engine.model_config.text.hidden_size))
