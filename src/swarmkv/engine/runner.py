"""ModelRunner: turn a step's plan into one flat batch, run the model over paged KV, return logits."""

from __future__ import annotations

import torch

from swarmkv.engine.cascade import CascadeMode, plan_groups
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, PrefillSpan, StepLayout
from swarmkv.engine.scheduler import Chunk, StepPlan
from swarmkv.engine.stats import EngineCounters
from swarmkv.models.decoder import DecoderForCausalLM


class ModelRunner:
    """Owns the KV tensors and the resident page tables; knows nothing about queues or sampling."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        counters: EngineCounters,
        cascade: CascadeMode = "auto",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.counters = counters
        self.cascade = cascade
        self.page_size = kv_cache.block_size
        self.device = page_table.device
        self.dtype = kv_cache.k.dtype

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[Chunk], torch.Tensor]:
        """Compute every chunk (after `update_page_table(plan)`); return the chunks that sample, in the
        order of their rows of float32 logits [N, vocab]."""
        prefills = [c for c in plan.chunks if c.kind == "prefill"]
        decodes = [c for c in plan.chunks if c.kind == "decode"]
        groups, decodes = self._group_decodes(decodes)
        ordered = prefills + decodes
        layout, input_ids, positions = self._layout(prefills, decodes, groups)
        hidden = self.model(input_ids, positions, PagedAttention(self.kv_cache, layout))
        sampling = [c for c in ordered if c.samples]
        ends, row = [], 0
        for chunk in ordered:
            row += chunk.num_tokens
            if chunk.samples:
                ends.append(row - 1)
        logits = self.model.compute_logits(hidden[torch.tensor(ends, dtype=torch.int64, device=self.device)])
        return sampling, logits

    def update_page_table(self, plan: StepPlan) -> None:
        """Drop freed requests' rows, append the pages each request gained, copy the changes once."""
        self.page_table.drop(plan.freed)
        for rid, pages in plan.new_pages.items():
            self.page_table.append(rid, pages)
        self.page_table.sync()

    def _group_decodes(self, decodes: list[Chunk]) -> tuple[list[tuple[int, int]], list[Chunk]]:
        """Cascade groups as (number of decodes, shared pages), grouped decodes first, in group order."""
        rows = [self.page_table.row(c.request_id) for c in decodes]
        shareable = [c.start // self.page_size for c in decodes]
        groups = plan_groups(self.page_table.host, rows, shareable, self.page_size, self.cascade)
        order = [i for g in groups for i in g.members]
        rest = sorted(set(range(len(decodes))) - set(order))
        sizes = [(len(g.members), g.num_pages) for g in groups]
        for g in groups:
            self.counters.cascade_decode_rows += len(g.members)
            self.counters.cascade_shared_tokens += g.num_pages * self.page_size
        return sizes, [decodes[i] for i in order + rest]

    def _layout(
        self, prefills: list[Chunk], decodes: list[Chunk], groups: list[tuple[int, int]]
    ) -> tuple[StepLayout, torch.Tensor, torch.Tensor]:
        dev, table = self.device, self.page_table
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
                bias = _bias(torch.arange(end)[None, :] <= pos[:, None], self.dtype)
                spans.append(PrefillSpan(q_start, chunk.num_tokens, key_slots, bias.to(dev)))
            q_start += chunk.num_tokens
        decode_groups: list[DecodeGroup] = []
        first = 0
        for size, num_pages in [*groups, (len(decodes) - sum(s for s, _ in groups), 0)]:
            if size:
                members = decodes[first : first + size]
                decode_groups.append(self._decode_group(members, q_start + first, num_pages))
            first += size
        layout = StepLayout(slot_mapping, tuple(spans), tuple(decode_groups))
        return layout, torch.tensor(ids, dtype=torch.int64, device=dev), positions

    def _decode_group(self, decodes: list[Chunk], q_start: int, num_shared_pages: int) -> DecodeGroup:
        """Key slots of each decode past its first `num_shared_pages` pages, padded, with their mask."""
        dev, table = self.device, self.page_table
        shared = num_shared_pages * self.page_size
        rows = torch.tensor([table.row(c.request_id) for c in decodes], device=dev)
        lengths = torch.tensor([c.start + 1 - shared for c in decodes])
        width = int(lengths.max())
        context = table.context_slots(rows, shared + width)[:, shared:]
        bias = _bias(torch.arange(width)[None, :] < lengths[:, None], self.dtype)
        shared_slots = table.context_slots(rows[:1], shared)[0] if num_shared_pages else None
        return DecodeGroup(q_start, context, bias[:, None, None, :].to(dev), shared_slots)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask (CPU SDPA is several times faster with these than with boolean masks)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
