"""Paged attention in plain PyTorch: prefill chunks over a cached prefix and batched decode, in one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmkv.engine.kv_cache import KVCache


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's prefill chunk: rows [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor | None  # [ctx] slots of the whole context; None when nothing precedes the chunk
    bias: torch.Tensor | None  # [q_len, ctx] additive mask: 0 where a query may attend, -inf elsewhere


@dataclass(frozen=True)
class DecodeGroup:
    """All single-token decodes of the step: rows [q_start, q_start + B) of the flat batch."""

    q_start: int
    key_slots: torch.Tensor  # [B, max_ctx], padded
    bias: torch.Tensor  # [B, 1, 1, max_ctx] additive mask: 0 on real keys, -inf on padding


@dataclass(frozen=True)
class StepLayout:
    """Where this step's tokens go in the cache and what each of them may attend to."""

    slot_mapping: torch.Tensor  # [T]
    prefills: tuple[PrefillSpan, ...]
    decode: DecodeGroup | None


class PagedAttention:
    """An AttentionBackend that writes new K/V into pages and attends over each sequence's page table."""

    def __init__(self, cache: KVCache, layout: StepLayout) -> None:
        self.cache = cache
        self.layout = layout

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v for the step's tokens, then attend every query over its own sequence's keys."""
        self.cache.write(layer, self.layout.slot_mapping, k, v)
        out = torch.empty_like(q)
        for span in self.layout.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            # 4-D [1, heads, tokens, dim] inputs: CPU SDPA takes its fast flash path only for those.
            query = q[rows].transpose(0, 1)[None]
            if span.key_slots is None:
                keys, values = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
                attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys, values = self.cache.gather(layer, span.key_slots)
                attn = F.scaled_dot_product_attention(
                    query,
                    keys.transpose(0, 1)[None],
                    values.transpose(0, 1)[None],
                    attn_mask=span.bias,
                    enable_gqa=True,
                )
            out[rows] = attn[0].transpose(0, 1)
        group = self.layout.decode
        if group is not None:
            rows = slice(group.q_start, group.q_start + group.key_slots.shape[0])
            keys, values = self.cache.gather(layer, group.key_slots)  # [B, ctx, Hkv, D]
            attn = F.scaled_dot_product_attention(
                q[rows].unsqueeze(2),  # [B, Hq, 1, D]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=group.bias,
                enable_gqa=True,
            )
            out[rows] = attn.squeeze(2)
        return out
