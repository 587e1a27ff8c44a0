"""What one forward carries beside the token embeddings and their positions: the DeepStack
features of its visual tokens (Qwen3-VL) and the per-request states of a hybrid model's
linear-attention layers (Qwen3.5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.linear.states import LinearStates


@dataclass(frozen=True)
class VisualEmbeds:
    """A request's encoded images and videos, in prompt order: one embedding per visual token
    ``[N, hidden]`` and, for Qwen3-VL, one ``[N, hidden]`` DeepStack feature per stacked
    decoder layer (empty otherwise)."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class StepExtras:
    """Per-forward inputs of the Qwen3 decoders (the Qwen2 ones read none of them).

    ``deepstack[i]`` ``[V, hidden]`` is added to the output of decoder layer ``i`` at the
    forward's rows ``deepstack_rows`` ``[V]`` (int64, on the model's device), the rows holding
    visual tokens whose features came with this forward. ``states`` is the hybrid model's view
    of its state pool for this forward (None for a model without linear attention)."""

    deepstack_rows: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = ()
    states: LinearStates | None = None


NO_EXTRAS = StepExtras()
