"""Pipeline-parallel prefill: the layout (which layers a stage owns), and a later stage's share
of the model and its KV pool.

Stage ``r`` of ``s`` owns the contiguous global layers ``[r*L//s, (r+1)*L//s)``. Its pool holds
only those layers, numbered locally from 0 but registered with their *global* ids, so the
transfer layer pairs each stage's buffers with the right decode layers (layer remapping).
The first stage embeds (text and images); the last stage applies the final norm and LM head,
samples and, with ``--draft``, runs the EAGLE draft (its pool mirrors the stage's pages and
carries the draft band's global layer id).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_device, resolve_dtype
from engine.draft_runner import DraftHead
from engine.errors import ConfigError
from engine.kv_cache import BufferInfo, KVPool, pages_for_budget
from engine.models.eagle import load_draft
from engine.models.qwen2_vl import Qwen2VLModel

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
    stage, the EAGLE draft when it runs one."""

    model_config: ModelConfig
    model: Qwen2VLModel
    layers: range
    pool: KVPool
    draft: DraftHead | None = None

    def buffer_infos(self) -> list[BufferInfo]:
        """The stage's KV buffer entries, the draft's after them (what transfer registers)."""
        extra = self.draft.pool.buffer_infos() if self.draft is not None else []
        return [*self.pool.buffer_infos(), *extra]


def stage_pool(config: EngineConfig, model_config: ModelConfig, layers: range,
               num_pages: int | None = None) -> KVPool:
    """A KV pool for ``layers`` only (``num_pages`` defaults to what the budget buys)."""
    device = resolve_device(config.device)
    text, dtype = model_config.text, resolve_dtype(config.dtype, device)
    pages = num_pages or config.num_pages or pages_for_budget(
        config.kv_budget_bytes, len(layers), config.page_size, text.num_key_value_heads,
        text.head_dim, dtype,
    )
    return KVPool(pages, config.page_size, text.num_key_value_heads, text.head_dim,
                  list(layers), dtype, device)


def load_later_stage(model_dir: Path, config: EngineConfig, layout: StageLayout,
                     draft: Path | None = None) -> LaterStageModel:
    """Load this stage's layers of the checkpoint (and nothing of the others) and build its
    pool; with ``draft`` (the last stage only) the EAGLE draft of that directory too."""
    layers = layout.layers(ModelConfig.from_dir(model_dir).text.num_hidden_layers)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_config, model = load_model(model_dir, dtype, device, layers)
    pool = stage_pool(config, model_config, layers)
    head = None
    if draft is not None:
        loaded = load_draft(draft, model_config.text, dtype, device=device)
        if loaded.cfg.eagle3 is not None:
            # its fc reads the outputs of layers spread over the earlier stages
            raise ConfigError(f"{draft}: an EAGLE-3 draft does not run beside a "
                              "pipeline-parallel prefill yet: run the prefill without "
                              "pipeline stages, or use an EAGLE-1/2 draft")
        head = DraftHead(loaded, model, pool)
    return LaterStageModel(model_config, model, layers, pool, head)
