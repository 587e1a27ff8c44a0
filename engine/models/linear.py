"""Linear layers with weights prepared once for the device's fastest matrix multiply.

On a CPU, torch's ``F.linear`` hands a weight stored ``[out, in]`` to a BLAS call that lays it
out for its kernels on every call; at one token (a matrix-vector product) it reached about half
the memory bandwidth a decode step is bound by. :class:`PreparedLinear` instead reorders the
weight once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
inductor's freezing does and vLLM's CPU build does) and multiplies through
``mkldnn._linear_pointwise``: on this project's CPU 1.7-3x faster at 1 to 512 rows in float32
and 1.1-1.6x in bfloat16 (float32 accumulation), measured over a 0.5B model's weights
(docs/performance.md). Elsewhere (CUDA, NPU, float16, a torch without oneDNN) it is
``F.linear`` over the plain weight.

Invariant: a prepared linear computes ``x @ weight.T + bias`` for the weight it was made from;
its results equal ``F.linear``'s within float32 rounding (bfloat16: the same bits on this CPU),
not bit for bit: the blocked product sums in another order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# the batch oneDNN lays a weight out for. Measured over a 0.5B model's 96 layer weights (2
# cores, float32): a layout for 32 rows multiplies 8 rows in 0.6x and 32 rows in 0.7x the time
# of the one-row layout, one row in the same time (within noise); 16 ~ 32, 8 slower at 32 rows
PACK_ROWS = 32
# set False (before a model is loaded) to keep every weight plain (``F.linear``): a process-wide
# switch for checks that need a module's plain weights after loading
PACKING = {"enabled": True}


def packs(weight: torch.Tensor) -> bool:
    """Whether :class:`PreparedLinear` reorders ``weight`` for oneDNN: a 2-D float32 or
    bfloat16 weight on a CPU whose torch has oneDNN (bfloat16 only where the CPU has native
    bfloat16 instructions: elsewhere oneDNN emulates them, slower than the plain product)."""
    if not PACKING["enabled"] or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class PreparedLinear:
    """``y = x @ weight.T + bias`` over a weight prepared once (see the module docstring).

    Holds either the packed weight (oneDNN's layout; the plain one is not kept) or the plain
    weight itself (a view, so in-place changes to it are seen). ``x`` is ``[..., in]``."""

    __slots__ = ("_packed", "_plain", "bias", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self._packed: torch.Tensor | None = None
        self._plain: torch.Tensor | None = None
        if packs(weight):
            with torch.inference_mode(False):  # reused by every later forward, in or out of it
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                     PACK_ROWS)
        else:
            self._plain = weight

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def weight(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (unpacked anew when packed: for checks, not forwards)."""
        if self._packed is not None:
            return self._packed.to_dense()
        assert self._plain is not None
        return self._plain

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self._plain, self.bias)  # type: ignore[arg-type]
        if x.numel() == 0:  # oneDNN refuses an empty batch
            return x.new_empty((*x.shape[:-1], self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias,
                                                  "none", [], "")


def empty_like_weight(weight: torch.Tensor) -> nn.Parameter:
    """A zero-element parameter of ``weight``'s dtype and device: what a projection keeps once
    its weight lives packed in a :class:`PreparedLinear` (the memory is freed)."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


def prepare_linears(
    groups: Sequence[Sequence[nn.Linear]],
) -> list[PreparedLinear]:
    """One :class:`PreparedLinear` per group of projections reading the same input, their
    weights (and biases) stacked by rows in the group's order.

    Where a group's weight is packed, its projections' weights become empty (the packed copy is
    the only one: a model's memory stays one copy of its weights); where it is not, they are
    re-pointed at their rows of the stacked weight, so an in-place change to one is seen by
    the next forward. Biases stay as they are (shared the same way)."""
    prepared = []
    for projs in groups:
        weight = torch.cat([p.weight.detach() for p in projs]) if len(projs) > 1 else (
            projs[0].weight.detach())
        biases = [p.bias for p in projs if p.bias is not None]
        bias = None
        if biases:
            assert len(biases) == len(projs), "a group's projections all have biases or none"
            bias = torch.cat([b.detach() for b in biases]) if len(projs) > 1 else biases[0]
        linear = PreparedLinear(weight, bias)
        _share_rows(projs, None if linear.packed else weight, bias)
        prepared.append(linear)
    return prepared


def _share_rows(
    projs: Sequence[nn.Linear], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> None:
    """Re-point each projection's parameters at its rows of the stacked ``weight``/``bias``
    (``weight`` None: the weights were packed; each becomes empty)."""
    row = 0
    for p in projs:
        n = p.weight.shape[0]
        p.weight = (empty_like_weight(p.weight) if weight is None
                    else nn.Parameter(weight[row : row + n], requires_grad=False))
        if bias is not None and p.bias is not None:
            p.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
