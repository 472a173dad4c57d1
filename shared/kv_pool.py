"""The KV pool: owns the tensor that holds every layer's K and V, page by page.

Layout is page-major, `[num_pages, num_layers, 2 (K/V), page_size, kv_heads, head_dim]`,
so a run of consecutive pages is one contiguous byte range across all layers: a
prompt's KV moves to another worker as a handful of descriptors, not one per layer.
Per-layer views (`k_cache(l)`, `v_cache(l)`) are strided `[num_pages, page_size, kv_heads, head_dim]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem


class KVPool:
    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu", scratch_page: bool = False) -> None:
        """`scratch_page`: one page beyond `num_pages`, never handed out, that padding rows of a static decode
        batch read and write (shared/decode_graphs.py)."""
        self.layout = layout
        self.scratch_page = layout.num_pages if scratch_page else None
        shape = (layout.num_pages + scratch_page, layout.num_layers, 2, layout.page_size, layout.num_kv_heads,
                 layout.head_dim)
        self.buffer = torch.zeros(shape, dtype=layout.dtype, device=device)
        # Each layer's views made once: slicing the buffer anew twice per layer and step cost ~5 % of a
        # batch-1 decode step's time on the CPU.
        self._k = [self.buffer[:, layer, 0] for layer in range(layout.num_layers)]
        self._v = [self.buffer[:, layer, 1] for layer in range(layout.num_layers)]

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._k[layer]  # [pages, page_size, kv_heads, head_dim], strided

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def copy_page(self, src: int, dst: int) -> None:
        self.buffer[dst].copy_(self.buffer[src])

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages
