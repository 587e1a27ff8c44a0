"""The linear-attention state pool: per Gated DeltaNet layer one conv state and one recurrent
state tensor, allocated once, indexed by state slot.

A running request owns exactly one slot (``engine.core.state_slots.StateSlotAllocator`` hands
them out) and only its rows read or write that slot's states, in every layer. A slot is zeroed
(:meth:`StatePool.reset`) before a new request computes its first token in it: a zero state is
the start of a sequence with no history. Unlike KV pages, a slot holds a request's whole past in
a fixed size, so it is never shared and never partly valid.

Layout: for local layer ``i`` (the position of its global id in ``layers``), ``conv(i)`` is
``[num_slots, C, K - 1]`` in the model dtype (the last ``K - 1`` inputs of the causal conv) and
``recurrent(i)`` is ``[num_slots, Hv, Dk, Dv]`` float32 (the delta rule's state).

Transfer contract (``transfer/plan/states.py``): :meth:`StatePool.buffer_infos` lists the
entries ``[conv_0 .. conv_{L-1}, rec_0 .. rec_{L-1}]``, each with its global layer id, so the
first occurrence of an id is its conv state and the second its recurrent state, and one slot of
an entry is ``bytes_per_page`` bytes at ``ptr + slot * bytes_per_page`` (a slot is an entry's
page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.pool import BufferInfo


def slot_bytes(num_layers: int, conv_channels: int, conv_kernel: int, num_v_heads: int,
               head_k_dim: int, head_v_dim: int, dtype: torch.dtype) -> int:
    """Bytes one slot takes over ``num_layers`` layers, both states."""
    elem = torch.empty((), dtype=dtype).element_size()
    conv = conv_channels * (conv_kernel - 1) * elem
    recurrent = num_v_heads * head_k_dim * head_v_dim * 4  # float32
    return num_layers * (conv + recurrent)


def slots_for_budget(budget_bytes: int, num_layers: int, conv_channels: int, conv_kernel: int,
                     num_v_heads: int, head_k_dim: int, head_v_dim: int, dtype: torch.dtype
                     ) -> int:
    """How many slots a memory budget buys (both states of every layer)."""
    per_slot = slot_bytes(num_layers, conv_channels, conv_kernel, num_v_heads, head_k_dim,
                          head_v_dim, dtype)
    return max(0, budget_bytes // per_slot)


class StatePool:
    """Conv and recurrent states of a set of linear-attention layers, by global layer id."""

    def __init__(
        self,
        num_slots: int,
        layers: list[int],
        conv_channels: int,
        conv_kernel: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots <= 0 or not layers:
            raise ValueError(f"a state pool needs slots and layers: {num_slots}, {layers}")
        if conv_kernel < 1:
            raise ValueError(f"conv kernel of {conv_kernel} taps")
        if len(set(layers)) != len(layers):
            raise ValueError(f"duplicate layer ids in {layers}")
        self.num_slots = num_slots
        self.layers = list(layers)
        self.conv_channels = conv_channels
        self.conv_kernel = conv_kernel
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.dtype = dtype
        conv_shape = (num_slots, conv_channels, conv_kernel - 1)
        recurrent_shape = (num_slots, num_v_heads, head_k_dim, head_v_dim)
        self._conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in layers]
        self._recurrent = [torch.zeros(recurrent_shape, dtype=torch.float32, device=device)
                           for _ in layers]

    @property
    def device(self) -> torch.device:
        """Where the states live."""
        return self._recurrent[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def conv(self, i: int) -> torch.Tensor:
        """Local layer ``i``'s conv states, ``[num_slots, C, K - 1]`` (model dtype)."""
        return self._conv[i]

    def recurrent(self, i: int) -> torch.Tensor:
        """Local layer ``i``'s recurrent states, ``[num_slots, Hv, Dk, Dv]`` float32."""
        return self._recurrent[i]

    def reset(self, slots: Sequence[int]) -> None:
        """Zero ``slots`` in every layer, both states (one batched write per tensor).

        Raises ``ValueError`` (changing nothing) on a slot outside ``[0, num_slots)``."""
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"state slots {bad} are outside [0, {self.num_slots})")
        if not slots:
            return
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        for tensor in (*self._conv, *self._recurrent):
            tensor.index_fill_(0, index, 0)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy both states of slots ``src`` into slots ``dst`` (pairwise, distinct ``dst``
        not among ``src``) in every layer. Raises ``ValueError`` (changing nothing) on a slot
        outside ``[0, num_slots)``."""
        bad = [s for s in (*src, *dst) if not 0 <= s < self.num_slots]
        if bad or len(src) != len(dst):
            raise ValueError(f"cannot copy state slots {list(src)} to {list(dst)} in a pool of "
                             f"{self.num_slots}")
        if not src:
            return
        index = torch.tensor([*src, *dst], dtype=torch.int64, device=self.device)
        source, target = index[: len(src)], index[len(src):]
        for tensor in (*self._conv, *self._recurrent):
            tensor.index_copy_(0, target, tensor.index_select(0, source))

    def buffer_infos(self) -> list[BufferInfo]:
        """Base address, byte length, bytes per slot (``bytes_per_page``), layer id and
        device of every state entry, in transfer order (see the module docstring)."""
        out = []
        for buf, lid in zip([*self._conv, *self._recurrent], [*self.layers, *self.layers],
                            strict=True):
            nbytes = buf.numel() * buf.element_size()
            out.append(BufferInfo(buf.data_ptr(), nbytes, nbytes // self.num_slots, lid,
                                  str(buf.device)))
        return out

    @property
    def conv_elem_bytes(self) -> int:
        """Bytes of one conv state element (the model dtype's)."""
        return self._conv[0].element_size()

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes in every layer, both states."""
        return slot_bytes(self.num_layers, self.conv_channels, self.conv_kernel,
                          self.num_v_heads, self.head_k_dim, self.head_v_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        """Bytes of every state tensor of the pool."""
        return self.num_slots * self.bytes_per_slot
