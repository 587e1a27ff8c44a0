"""The gated RMS norm that follows a Gated DeltaNet layer's rule (norm first, then the gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """``weight * rms_norm(x) * silu(gate)`` over the last dim, in ``x``'s dtype.

    ``x`` and ``gate`` ``[..., D]``, ``weight`` ``[D]``. The norm runs in float32 and is cast back
    to ``x``'s dtype before the weight, and the gate is applied in float32, as transformers'
    ``Qwen3_5RMSNormGated`` does, so low-precision outputs round the same way.
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)
