"""Small building blocks shared by the decoder, the vision tower and the draft model."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError

TensorFn = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm gives the float32 formula's result, ``h * rsqrt(mean(h^2) + eps)``, bit for
        # bit, in fewer ops; a narrower dtype is normalised in float32, cast back, then scaled
        # (the reference's order: the weight multiplies in the model's dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * h.to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """RMS normalisation scaled by ``1 + weight`` (Qwen3.5's zero-centred norms: a checkpoint's
    weight 0 is the identity scale), the product taken in float32 before the cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(dim: int, eps: float, *, offset: bool) -> RMSNorm:
    """:class:`OffsetRMSNorm` when ``offset`` (``TextConfig.zero_centered_norm``), else
    :class:`RMSNorm`."""
    return OffsetRMSNorm(dim, eps) if offset else RMSNorm(dim, eps)


class DeviceCopies:
    """A constant tensor made once on the host, and its copy on each device asked for, made the
    first time that device asks: a forward on an accelerator reads a cached device tensor and
    creates nothing on the host. The copies are ordinary tensors even when first asked for
    under ``torch.inference_mode`` (an inference tensor cached here would break every later
    autograd use, such as a training script running after the engine)."""

    def __init__(self, host: torch.Tensor) -> None:
        self._copies = {host.device: host}
        self._host = host

    def on(self, device: torch.device) -> torch.Tensor:
        copy = self._copies.get(device)
        if copy is None:
            with torch.inference_mode(False):
                copy = self._copies[device] = self._host.to(device)
        return copy


_SWAPS: dict[int, DeviceCopies] = {}  # half width -> the swap index


def _swap_index(half: int, device: torch.device) -> torch.Tensor:
    """``[2 * half]`` indices on ``device`` that swap the two halves of the last dimension."""
    swaps = _SWAPS.get(half)
    if swaps is None:
        with torch.inference_mode(False):  # a constant of every later forward (DeviceCopies)
            swaps = _SWAPS[half] = DeviceCopies(torch.cat((
                torch.arange(half, 2 * half, device="cpu"), torch.arange(half, device="cpu"))))
    return swaps.on(device)


class RotaryTables:
    """Rotary embedding of ``T`` tokens: ``x -> x * cos + rotate_half(x) * sin`` where
    ``rotate_half([x1, x2]) = [-x2, x1]``. The sign is folded into ``signed_sin`` and the half swap
    is one index_select, so a rotation is four ops with bit-identical results. Every tensor is on
    the device of ``cos`` (the swap index is made once per width and device)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = cos.shape[-1] // 2
        self.cos = cos.unsqueeze(1)
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
        self.swap = _swap_index(half, cos.device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]``; with tables narrower than ``D`` (partial rotary) only
        the leading channels turn and the rest pass through."""
        width = self.cos.shape[-1]
        if width != x.shape[-1]:
            rot = x[..., :width]
            turned = rot * self.cos + rot.index_select(-1, self.swap) * self.signed_sin
            return torch.cat((turned, x[..., width:]), dim=-1)
        return x * self.cos + x.index_select(-1, self.swap) * self.signed_sin


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """Rotary inverse frequencies ``[dim // 2]`` in float32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def mrope_axes(half: int, mrope_section: tuple[int, int, int], interleaved: bool) -> list[int]:
    """The position axis (0 temporal, 1 height, 2 width) of each of ``half`` rotary frequencies.

    Sectioned (Qwen2-VL): the first ``mrope_section[0]`` frequencies are temporal, the next
    ``mrope_section[1]`` height, the rest width. Interleaved (Qwen3): frequency ``j`` is height
    when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, width when ``j % 3 == 2`` and
    ``j < 3 * mrope_section[2]``, temporal otherwise (sections longer than ``half`` are cut,
    as transformers' slicing cuts them)."""
    if not interleaved:
        return [axis for axis, n in enumerate(mrope_section) for _ in range(n)]
    axes = []
    for j in range(half):
        if j % 3 == 1 and j < 3 * mrope_section[1]:
            axes.append(1)
        elif j % 3 == 2 and j < 3 * mrope_section[2]:
            axes.append(2)
        else:
            axes.append(0)
    return axes


class MropeRotary:
    """cos/sin tables for the decoder from 3-D positions.

    Frequency ``j`` of the ``rotary_dim / 2`` rotary frequencies takes its position from axis
    ``axis_of[j]`` (:func:`mrope_axes`). The tables are computed on the positions' device (the
    constants are copied there once) and stay float32 until the end, whatever the model's dtype.
    ``rotary_dim`` may be narrower than a head (partial rotary): :meth:`RotaryTables.apply`
    then turns the leading channels only.
    """

    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int],
                 interleaved: bool = False) -> None:
        self.inv_freq = DeviceCopies(inverse_frequencies(rotary_dim, theta))  # [D/2]
        axes = mrope_axes(rotary_dim // 2, mrope_section, interleaved)
        self.axis_of = DeviceCopies(torch.tensor(axes, dtype=torch.long, device="cpu"))  # [D/2]

    def __call__(self, mrope_positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """``mrope_positions`` ``[3, T]`` -> rotation tables for ``T`` tokens."""
        device = mrope_positions.device
        pos = mrope_positions.index_select(0, self.axis_of.on(device)).t().float()  # [T, D/2]
        freqs = pos * self.inv_freq.on(device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return RotaryTables(emb.cos().to(dtype), emb.sin().to(dtype))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, TensorFn] = {
    "silu": nn.functional.silu,
    "quick_gelu": quick_gelu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def activation(name: str) -> TensorFn:
    """The activation function called ``name`` in Hugging Face configs."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        known = sorted(ACTIVATIONS)
        raise ConfigError(f"unsupported activation {name!r}; known: {known}") from None

