"""The torch attention backend (the reference, and the CPU path): prefill chunks over a cached prefix and
batched decode in one step, with SDPA over gathered keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmkv.core.scheduler import Chunk
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's prefill chunk: rows [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor | None  # [ctx] slots of the whole context; None when nothing precedes the chunk
    bias: torch.Tensor | None  # [q_len, ctx] additive mask: 0 where a query may attend, -inf elsewhere


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token decodes: rows [q_start, q_start + B) of the flat batch.

    With `shared_slots`, the group's page tables begin with the same pages: those keys are read once for
    the whole group (cascade attention) and `key_slots` holds only each sequence's own suffix.
    """

    q_start: int
    key_slots: torch.Tensor  # [B, max_ctx], padded
    bias: torch.Tensor  # [B, 1, 1, max_ctx] additive mask: 0 on real keys, -inf on padding
    shared_slots: torch.Tensor | None = None  # [P] slots of the pages every sequence in the group holds


@dataclass(frozen=True)
class StepLayout:
    """Where this step's tokens go in the cache and what each of them may attend to."""

    slot_mapping: torch.Tensor  # [T]
    prefills: tuple[PrefillSpan, ...]
    decodes: tuple[DecodeGroup, ...]


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
        for group in self.layout.decodes:
            rows = slice(group.q_start, group.q_start + group.key_slots.shape[0])
            out[rows] = self._decode(layer, q[rows], group)
        return out

    def _decode(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """Each query [B, Hq, D] against its own keys, or through the shared prefix if the group has one."""
        if group.shared_slots is not None:
            return self._cascade_decode(layer, q, group)
        keys, values = self.cache.gather(layer, group.key_slots)  # [B, ctx, Hkv, D]
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.bias,
            enable_gqa=True,
        )
        return attn.squeeze(2)

    def _cascade_decode(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """Decode attention split at the shared prefix (Hydragen): one batched read of the prefix for the
        whole group, one per-sequence read of each suffix, merged exactly through their log-sum-exps."""
        assert group.shared_slots is not None
        batch, num_heads, dim = q.shape
        out_dtype = q.dtype
        wide = torch.promote_types(q.dtype, torch.float32)  # merge in float32 at least, as SDPA accumulates
        q = q.to(wide)
        shared_k, shared_v = (t.to(wide) for t in self.cache.gather(layer, group.shared_slots))  # [P, Hkv, D]
        kv_heads = shared_k.shape[1]
        group_size = num_heads // kv_heads
        scale = dim**-0.5
        q_grouped = q.view(batch, kv_heads, group_size, dim)
        # Prefix: every query of every sequence against one copy of the prefix keys.
        q_prefix = q_grouped.transpose(0, 1).reshape(kv_heads, batch * group_size, dim)
        scores = torch.bmm(q_prefix, shared_k.permute(1, 2, 0)).mul_(scale)  # [Hkv, B*G, P]
        prefix_max = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - prefix_max)
        prefix_sum = weights.sum(-1, keepdim=True)
        prefix_out = torch.bmm(weights, shared_v.transpose(0, 1))  # [Hkv, B*G, D], unnormalised

        def per_sequence(x: torch.Tensor) -> torch.Tensor:
            return x.view(kv_heads, batch, group_size, -1).transpose(0, 1)  # -> [B, Hkv, G, *]

        prefix_max, prefix_sum, prefix_out = (
            per_sequence(prefix_max),
            per_sequence(prefix_sum),
            per_sequence(prefix_out),
        )
        # Suffix: each sequence against its own keys (at least the token being decoded).
        own_k, own_v = (t.to(wide) for t in self.cache.gather(layer, group.key_slots))  # [B, S, Hkv, D]
        scores = torch.matmul(q_grouped, own_k.permute(0, 2, 3, 1)).mul_(scale) + group.bias.to(wide)
        own_max = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - own_max)
        own_sum = weights.sum(-1, keepdim=True)
        own_out = torch.matmul(weights, own_v.transpose(1, 2))  # [B, Hkv, G, D]
        both_max = torch.maximum(prefix_max, own_max)
        prefix_scale, own_scale = torch.exp(prefix_max - both_max), torch.exp(own_max - both_max)
        merged = (prefix_out * prefix_scale + own_out * own_scale) / (
            prefix_sum * prefix_scale + own_sum * own_scale
        )
        return merged.reshape(batch, num_heads, dim).to(out_dtype)


def build_layout(
    table: PageTable,
    prefills: list[Chunk],
    decodes: list[Chunk],
    groups: list[tuple[int, int]],
    dtype: torch.dtype,
) -> tuple[StepLayout, torch.Tensor, torch.Tensor]:
    """The torch backend's layout of a step (prefills, then decodes with the cascade `groups` first, as
    (members, shared pages)), with its input ids and positions on the device."""
    dev = table.device
    ordered = prefills + decodes
    ids = [t for c in ordered for t in c.token_ids]
    positions = torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in ordered]).to(dev)
    rows_host = [table.row(c.request_id) for c in ordered]
    token_rows = torch.repeat_interleave(
        torch.tensor(rows_host), torch.tensor([c.num_tokens for c in ordered])
    ).to(dev)
    slot_mapping = table.slots(token_rows, positions)
    spans: list[PrefillSpan] = []
    q_start = 0
    for chunk, row in zip(prefills, rows_host, strict=False):
        if chunk.start == 0:
            spans.append(PrefillSpan(q_start, chunk.num_tokens, None, None))
        else:
            end = chunk.start + chunk.num_tokens
            key_slots = table.context_slots(torch.tensor([row], device=dev), end)[0]
            pos = torch.arange(chunk.start, end)
            bias = _bias(torch.arange(end)[None, :] <= pos[:, None], dtype)
            spans.append(PrefillSpan(q_start, chunk.num_tokens, key_slots, bias.to(dev)))
        q_start += chunk.num_tokens
    decode_groups: list[DecodeGroup] = []
    first = 0
    for size, num_pages in [*groups, (len(decodes) - sum(s for s, _ in groups), 0)]:
        if size:
            members = decodes[first : first + size]
            decode_groups.append(_decode_group(table, members, q_start + first, num_pages, dtype))
        first += size
    layout = StepLayout(slot_mapping, tuple(spans), tuple(decode_groups))
    return layout, torch.tensor(ids, dtype=torch.int64, device=dev), positions


def _decode_group(
    table: PageTable, decodes: list[Chunk], q_start: int, num_shared_pages: int, dtype: torch.dtype
) -> DecodeGroup:
    """Key slots of each decode past its first `num_shared_pages` pages, padded, with their mask."""
    dev = table.device
    shared = num_shared_pages * table.page_size
    rows = torch.tensor([table.row(c.request_id) for c in decodes], device=dev)
    lengths = torch.tensor([c.start + 1 - shared for c in decodes])
    width = int(lengths.max())
    context = table.context_slots(rows, shared + width)[:, shared:]
    bias = _bias(torch.arange(width)[None, :] < lengths[:, None], dtype)
    shared_slots = table.context_slots(rows[:1], shared)[0] if num_shared_pages else None
    return DecodeGroup(q_start, context, bias[:, None, None, :].to(dev), shared_slots)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask (CPU SDPA is several times faster with these than with boolean masks)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
