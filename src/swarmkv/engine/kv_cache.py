"""The KV tensors behind the page pool: one K and one V slab per layer, addressed by slot = page * block + offset.

Slabs are stored in the model's dtype, or in fp8 (e4m3): then each layer's K and V carry one scale each
(stored = value / scale), calibrated once at start-up on a short text, so fp8 pages hold twice the tokens of
float16 ones (four times float32's). Readers de-scale in the model's dtype.
"""

from __future__ import annotations

import torch

from swarmkv.config import ModelConfig
from swarmkv.kernels.huge_pages import huge_zeros

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def kv_storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved `kv_cache_dtype` name (`swarmkv.resolve.kv_cache_dtype`)."""
    return FP8 if name == "fp8_e4m3" else getattr(torch, name)


class KVCache:
    """Preallocated K/V storage for every page of the pool."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        storage_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype` is the model's (what readers get back); `storage_dtype` what pages hold (default: the same)."""
        num_layers = config.num_attention_layers  # a hybrid's linear-attention layers keep no KV
        shape = (num_layers, num_pages * block_size, config.num_kv_heads, config.head_dim)
        self.dtype = dtype
        self.storage_dtype = storage_dtype or dtype
        self.k = huge_zeros(shape, self.storage_dtype, torch.device(device))
        self.v = huge_zeros(shape, self.storage_dtype, torch.device(device))
        self.block_size = block_size
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @property
    def is_fp8(self) -> bool:
        """Whether pages hold fp8 values that readers de-scale."""
        return self.storage_dtype == FP8

    def calibrate(self, k_amax: list[float], v_amax: list[float]) -> None:
        """Set each fp8 layer's scales from the largest |K| and |V| seen, with 2x headroom for longer texts. A
        layer the calibration text never ran (an MTP layer's slab) takes the largest of the others'."""
        k_amax = [a or max(k_amax) for a in k_amax]
        v_amax = [a or max(v_amax) for a in v_amax]
        self.k_scales = [max(a * 2 / FP8_MAX, 1e-6) for a in k_amax]
        self.v_scales = [max(a * 2 / FP8_MAX, 1e-6) for a in v_amax]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V [T, Hkv, D] at their slots [T]."""
        if self.is_fp8:
            # Indexed assignment: index_copy_ has no fp8 kernel on the CPU.
            self.k[layer][slots] = _to_fp8(k, self.k_scales[layer])
            self.v[layer][slots] = _to_fp8(v, self.v_scales[layer])
            return
        self.k[layer].index_copy_(0, slots, k.to(self.storage_dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.storage_dtype))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's K and V of page `src` into page `dst`."""
        size = self.block_size
        for slab in (self.k, self.v):
            slab[:, dst * size : (dst + 1) * size] = slab[:, src * size : (src + 1) * size]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the given slots (any shape S) -> [*S, Hkv, D], in the model's dtype."""
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        if self.is_fp8:
            k = k.to(self.dtype) * self.k_scales[layer]
            v = v.to(self.dtype) * self.v_scales[layer]
        else:  # pages narrower than the model (bfloat16 under float32) are read back at its width
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])


def _to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
