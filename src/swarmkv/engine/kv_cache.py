"""The KV tensors behind the page pool: one K and one V slab per layer, addressed by slot = page * block + offset."""

from __future__ import annotations

import torch

from swarmkv.config import ModelConfig


class KVCache:
    """Preallocated K/V storage for every page of the pool."""

    def __init__(
        self, config: ModelConfig, num_pages: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, num_pages * block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V [T, Hkv, D] at their slots [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's K and V of page `src` into page `dst`."""
        size = self.block_size
        for slab in (self.k, self.v):
            slab[:, dst * size : (dst + 1) * size] = slab[:, src * size : (src + 1) * size]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the given slots (any shape S) -> [*S, Hkv, D]."""
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
