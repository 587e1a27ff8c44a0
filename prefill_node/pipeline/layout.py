"""Pipeline-parallel prefill: the layout (which layers a stage owns), and a later stage's share
of the model and its KV pool.

Stage ``r`` of ``s`` owns the contiguous global layers ``[r*L//s, (r+1)*L//s)``. Its pool holds
only those layers, numbered locally from 0 but registered with their *global* ids, so the
transfer layer pairs each stage's buffers with the right decode layers (layer remapping). A
hybrid model's stage holds KV for its full-attention layers and a state pool for its
linear-attention ones, both registered by global id (each stage needs one full-attention layer).
The first stage embeds (text and images); the last stage applies the final norm and LM head,
samples and, with ``--draft``, runs the EAGLE draft (its pool mirrors the stage's pages and
carries the draft band's global layer id).

With ``config.tp_size`` ``N > 1`` a later stage is rank 0 of ``N`` tensor-parallel processes
(:class:`engine.parallel.driver.TPDriver`), each holding its heads of the stage's layers and pages
(every rank's pool holds the same page count). Each stage picks its own ``N``: what it sends
on is rank 0's whole hidden state, and each stage describes its own KV heads to decodes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.attention.backend import AttentionBatch
from engine.attention.linear.states import LinearStates
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_device, resolve_dtype
from engine.errors import ConfigError
from engine.kv.pool import KVPool, pages_for_budget
from engine.llm_engine import hybrid_states
from engine.models.eagle.loader import load_draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.parallel.driver import TPDriver
from engine.parallel.group import SINGLE
from engine.parallel.messages import StateStep
from engine.parallel.rank import RankAttach
from engine.parallel.shard import TextShard
from engine.runner.draft_runner import DraftHead
from engine.sampling.structured import StructuredOutputs

DRAFT_ON_EARLY_STAGE = ("--draft goes to the last pipeline stage only (it runs the EAGLE draft; "
                        "the stages before it learn of the draft from their --pp-next)")


@dataclass(frozen=True)
class StageLayout:
    """Where a process sits in a prefill pipeline of ``size`` stages, hence its layers."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline rank {self.rank} is outside 0..{self.size - 1}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The global layer ids this stage owns."""
        if num_layers < self.size:
            raise ValueError(f"{num_layers} layers cannot be split into {self.size} stages")
        return range(self.rank * num_layers // self.size, (self.rank + 1) * num_layers // self.size)


@dataclass
class LaterStageModel:
    """A later stage's share of the model: its layers' weights and its KV pool; on the last
    stage, the EAGLE draft when it runs one; with tensor parallelism, the driver of the other
    ranks (:meth:`step` wraps every forward, :meth:`close` ends them)."""

    model_config: ModelConfig
    model: Qwen2VLModel
    layers: range
    pool: KVPool  # the full-attention layers among ``layers``
    draft: DraftHead | None = None
    tp: TPDriver | None = None
    states: LinearStates | None = None  # a hybrid model's linear-attention layers among them
    structured: StructuredOutputs | None = None  # the last stage's grammars (its first tokens)

    @property
    def rank_payloads(self) -> list[bytes]:
        """What the attach hook returned in ranks ``1..`` (empty with one rank)."""
        return list(self.tp.payloads) if self.tp is not None else []

    def step(self, hidden: torch.Tensor, mrope: torch.Tensor, batch: AttentionBatch,
             states: StateStep | None = None) -> AbstractContextManager[None]:
        """Where this stage's forward over ``hidden`` ``[T, H]`` runs: inside the driver's step
        (the other ranks run it too, applying ``states`` to their state pools) with tensor
        parallelism, else a no-op context."""
        if self.tp is None:
            return nullcontext()
        return self.tp.step(hidden, mrope, batch, states=states)

    def close(self) -> None:
        """End the other tensor-parallel ranks' processes (nothing with one rank)."""
        if self.tp is not None:
            self.tp.close()

    def pools(self) -> list[KVPool]:
        """The stage's KV pool, the draft's after it (what transfer registers)."""
        return [self.pool] if self.draft is None else [self.pool, self.draft.pool]


def load_later_stage(model_dir: Path, config: EngineConfig, layout: StageLayout,
                     draft: Path | None = None, attach: RankAttach | None = None
                     ) -> LaterStageModel:
    """Load this stage's layers of the checkpoint (and nothing of the others) and build its
    pool (its pages are what the budget buys, unless ``config.num_pages``); with ``draft`` (the
    last stage only) the EAGLE draft of that directory too. With ``config.tp_size`` above 1
    the other ranks' processes are started first and load theirs (their share of the draft's
    layer too) meanwhile; ``attach`` runs in each once its pools exist
    (:data:`engine.parallel.rank.RankAttach`)."""
    text = ModelConfig.from_dir(model_dir).text
    layers = layout.layers(text.num_hidden_layers)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    shard = TextShard.of(text, 0, config.tp_size)  # this rank's heads
    kv_layers = text.attention_layers(layers)  # a hybrid model's linear layers hold no KV
    if not kv_layers:
        raise ConfigError(f"pipeline stage {layout.rank} holds layers {list(layers)}, none of "
                          "them full attention: split the model so each stage holds one")
    pages = config.num_pages or pages_for_budget(
        config.kv_budget_bytes, len(kv_layers), config.page_size, shard.num_kv_heads,
        text.head_dim, dtype)
    tp = None
    if config.tp_size > 1:
        # a rank's pool holds one page more than it is told (an engine's scratch page)
        tp = TPDriver(model_dir, replace(config, layers=layers), pages - 1, attach, draft)
    try:
        model_config, model = load_model(model_dir, dtype, device, layers,
                                         tp.group if tp is not None else SINGLE)
        if tp is not None:
            tp.connect(device)
    except BaseException:
        if tp is not None:
            tp.close()
        raise
    pool = KVPool(pages, config.page_size, shard.num_kv_heads, text.head_dim, kv_layers, dtype,
                  device)
    states = hybrid_states(text, layers, config.num_state_slots, dtype, device, shard,
                           verify_states=config.verify_states)
    head = None
    if draft is not None:
        loaded = load_draft(draft, model_config.text, dtype, device=device,
                            tp=tp.group if tp is not None else SINGLE)
        head = DraftHead(loaded, model, pool, tp)
    return LaterStageModel(model_config, model, layers, pool, head, tp, states,
                           StructuredOutputs(model_dir))
