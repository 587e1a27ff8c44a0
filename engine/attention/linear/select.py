"""Which linear-attention kernels a device gets.

Off CUDA, and by default: the torch reference (``conv``, ``delta_rule``). On CUDA each kernel
comes from its library when that is importable, flash-linear-attention for the gated delta rule
and causal-conv1d for the conv (``libraries``: fla's checked on a GPU, causal-conv1d's not
yet), and from the torch reference otherwise; a missing library is logged once. The libraries
are imported here only, and only when a CUDA device asks.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Protocol

import torch

from engine.attention.linear import conv, delta_rule, libraries

log = logging.getLogger(__name__)


class CausalConv1d(Protocol):
    """:func:`engine.attention.linear.conv.causal_conv1d`'s interface."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 q_starts: Sequence[int], conv_state: torch.Tensor, slots: torch.Tensor,
                 activation: str | None = "silu") -> torch.Tensor: ...


class GatedDeltaRule(Protocol):
    """:func:`engine.attention.linear.delta_rule.gated_delta_rule`'s interface."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, q_starts: Sequence[int], state: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LinearAttentionKernels:
    """The two kernels of a Gated DeltaNet layer, and where each comes from (``"torch"``,
    ``"causal_conv1d"``, ``"fla"``)."""

    conv: CausalConv1d
    delta_rule: GatedDeltaRule
    conv_from: str = "torch"
    delta_rule_from: str = "torch"


TORCH_KERNELS = LinearAttentionKernels(conv.causal_conv1d, delta_rule.gated_delta_rule)


def linear_kernels(device: torch.device) -> LinearAttentionKernels:
    """The kernels for ``device`` (see the module docstring)."""
    if device.type != "cuda":
        return TORCH_KERNELS
    kernels = TORCH_KERNELS
    fla = _library("fla.ops.gated_delta_rule", "flash-linear-attention", "gated delta rule")
    if fla is not None:
        kernels = replace(kernels, delta_rule=libraries.FlaGatedDeltaRule(fla),
                          delta_rule_from="fla")
    lib = _library("causal_conv1d", "causal-conv1d", "causal conv")
    if lib is not None:
        kernels = replace(kernels, conv=libraries.LibraryCausalConv1d(lib),
                          conv_from="causal_conv1d")
    return kernels


@functools.cache
def _library(module: str, package: str, what: str) -> ModuleType | None:
    """``module`` imported, or None (said once in the log) when ``package`` is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        log.warning("%s is not importable (%s): the %s runs in the torch reference on CUDA; "
                    "pip install %s for its CUDA kernel", package, err, what, package)
        return None
