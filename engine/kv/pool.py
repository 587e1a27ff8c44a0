"""The paged KV pool: one K and one V buffer per layer, allocated once.

Layout contract (shared with ``transfer/``): each buffer is a contiguous tensor of shape
``[num_pages, page_size, num_kv_heads, head_dim]``. Buffer entries are ordered
``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]`` and each entry carries a *global* layer id, so the first
occurrence of an id is its K buffer and the second its V buffer. A draft model's pool uses ids in
the band ``num_hidden_layers + i``. A token's slot is ``page * page_size + offset``
(:func:`slot_of`), computed nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferInfo:
    """What the transfer layer registers for one buffer entry.

    ``device`` names where the bytes at ``ptr`` live, as torch spells it: ``"cpu"`` for host
    memory, ``"cuda:N"`` or ``"npu:N"`` for an accelerator's memory; the transfer manager picks
    the engine's registration path from it.
    """

    ptr: int  # base address of the buffer
    nbytes: int  # total bytes of the buffer
    bytes_per_page: int  # bytes of one page of this buffer
    layer_id: int  # global layer id of this entry
    device: str = "cpu"  # where the buffer lives: "cpu", "cuda:N", "npu:N"


def slot_of(page: int, page_size: int, offset: int) -> int:
    """The flat slot index of token ``offset`` inside ``page``."""
    return page * page_size + offset


def pages_for_budget(
    budget_bytes: int, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many pages a memory budget buys (K and V of every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * elem
    return max(0, budget_bytes // per_page)


class KVPool:
    """K and V buffers for a set of layers, with global layer ids per entry."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        layer_ids: list[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive: {num_pages}, {page_size}")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"duplicate layer ids in {layer_ids}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layer_ids = list(layer_ids)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # k[i], v[i]: [num_pages, page_size, num_kv_heads, head_dim] for local layer i
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layer_ids]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layer_ids]

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self.k[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def entries(self) -> list[torch.Tensor]:
        """Buffer entries in transfer order: all K buffers, then all V buffers."""
        return [*self.k, *self.v]

    def entry_layer_ids(self) -> list[int]:
        """The global layer id of each entry of :meth:`entries`."""
        return [*self.layer_ids, *self.layer_ids]

    def buffer_infos(self) -> list[BufferInfo]:
        """Base address, byte length, bytes per page, layer id and device of every entry."""
        out = []
        for buf, lid in zip(self.entries(), self.entry_layer_ids(), strict=True):
            nbytes = buf.numel() * buf.element_size()
            out.append(
                BufferInfo(buf.data_ptr(), nbytes, nbytes // self.num_pages, lid, str(buf.device))
            )
        return out

    def flat_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K buffer viewed as ``[num_slots, num_kv_heads, head_dim]``."""
        return self.k[layer].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V buffer viewed as ``[num_slots, num_kv_heads, head_dim]``."""
        return self.v[layer].view(self.num_slots, self.num_kv_heads, self.head_dim)


def move_kv(pool: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of slots ``src`` ``[M]`` to slots ``dst`` ``[M]`` in every layer of
    ``pool`` (all sources are read before any destination is written)."""
    for layer in range(pool.num_layers):
        for flat in (pool.flat_k(layer), pool.flat_v(layer)):
            flat.index_copy_(0, dst, flat.index_select(0, src))
