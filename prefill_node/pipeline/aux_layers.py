"""The outputs of an EAGLE-3 draft's target layers on their way down a pipeline.

An EAGLE-3 draft on the last stage fuses the outputs of three target layers (``aux_ids``, in the
draft's order), which may lie on any stage. Every step carries, next to the hidden states, the
outputs of those of them computed so far: a step leaving a stage whose layers end at ``stop``
carries :func:`carried` ``(aux_ids, stop)``, float32 ``[T, k * H]`` (``StageStep.aux``). Each
stage adds its own layers' outputs in their places, so the last stage holds all three, in the
draft's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.convert import ConversionError
from proto.pdserve.v1 import worker_pb2 as wpb


def carried(aux_ids: Sequence[int], stop: int) -> list[int]:
    """The aux layers a step carries once the layers below ``stop`` ran: those of ``aux_ids``
    below ``stop``, in ``aux_ids``'s order."""
    return [i for i in aux_ids if i < stop]


def pack_aux(aux: torch.Tensor) -> bytes:
    """``[T, k * H]`` as float32 bytes (empty when ``k`` is 0)."""
    if not aux.shape[1]:
        return b""
    return aux.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()


def unpack_aux(step: wpb.StageStep, count: int, hidden_size: int) -> torch.Tensor:
    """The step's aux outputs, float32 ``[T, count * H]``; ``ConversionError`` unless they
    match its tokens and the ``count`` layers the sender must have computed."""
    t = sum(it.num_tokens for it in step.items)
    aux = torch.frombuffer(bytearray(step.aux), dtype=torch.float32) if step.aux else (
        torch.empty(0))
    if aux.numel() != t * count * hidden_size:
        raise ConversionError(f"the step carries {aux.numel()} aux values, not the outputs of "
                              f"{count} target layers over its {t} tokens")
    return aux.view(t, count * hidden_size)


def merge_aux(aux_ids: Sequence[int], layers: range, received: torch.Tensor,
              own: dict[int, torch.Tensor], rows: Sequence[int] | slice) -> torch.Tensor:
    """What a stage of ``layers`` sends on: ``received`` (``carried(aux_ids, layers.start)``,
    float32 ``[T, k * H]``) with the outputs of its own aux layers (``own``, by layer id, each
    ``[len(rows), H]``, at ``rows`` of the step; its other rows stay zero) in their places:
    float32 ``[T, k' * H]`` in the order of ``carried(aux_ids, layers.stop)``."""
    before, after = carried(aux_ids, layers.start), carried(aux_ids, layers.stop)
    if not after:
        return received
    blocks: dict[int, torch.Tensor] = {}
    if before:  # a repeated layer's blocks are equal: either serves
        width = received.shape[1] // len(before)
        blocks.update(zip(before, received.split(width, dim=1), strict=True))
    for lid, out in own.items():
        blocks[lid] = received.new_zeros(received.shape[0], out.shape[1])
        blocks[lid][rows] = out.float()
    return torch.cat([blocks[i] for i in after], dim=1)
