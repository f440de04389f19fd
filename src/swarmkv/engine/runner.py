"""ModelRunner: turn a step's chunks into one flat batch, run the model over paged KV, return logits."""

from __future__ import annotations

import torch

from swarmkv.engine.kv_cache import KVCache, page_slots
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, PrefillSpan, StepLayout
from swarmkv.engine.scheduler import Chunk
from swarmkv.models.decoder import DecoderForCausalLM


class ModelRunner:
    """Owns the KV tensors and runs the model; knows nothing about queues or sampling."""

    def __init__(
        self, model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device, cascade: bool = True
    ) -> None:
        self.model = model
        self.cascade = cascade
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.dtype = kv_cache.k.dtype

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor]:
        """Compute every chunk; return the chunks that sample and their float32 logits [N, vocab]."""
        ordered = [c for c in chunks if c.kind == "prefill"] + [c for c in chunks if c.kind == "decode"]
        layout, input_ids, positions = self._layout(ordered)
        hidden = self.model(input_ids, positions, PagedAttention(self.kv_cache, layout))
        sampling = [c for c in ordered if c.samples]
        ends, row = [], 0
        for chunk in ordered:
            row += chunk.num_tokens
            if chunk.samples:
                ends.append(row - 1)
        logits = self.model.compute_logits(hidden[torch.tensor(ends, dtype=torch.int64, device=self.device)])
        return sampling, logits

    def _layout(self, ordered: list[Chunk]) -> tuple[StepLayout, torch.Tensor, torch.Tensor]:
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions, slot_mapping = [], []
        prefills: list[PrefillSpan] = []
        decode_slots: list[torch.Tensor] = []
        row = 0
        for chunk in ordered:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            ids += seq.token_ids[start:end]
            pos = torch.arange(start, end)
            positions.append(pos)
            slots = page_slots(seq.page_table, end, bs)
            slot_mapping.append(slots[start:])
            if chunk.kind == "decode":
                decode_slots.append(slots)
            elif start == 0:
                prefills.append(PrefillSpan(row, chunk.num_tokens, None, None))
            else:
                bias = _bias(torch.arange(end)[None, :] <= pos[:, None], self.dtype)
                prefills.append(PrefillSpan(row, chunk.num_tokens, slots.to(dev), bias.to(dev)))
            row += chunk.num_tokens
        decodes = [c for c in ordered if c.kind == "decode"]
        decode = self._decode_group(decodes, decode_slots, row - len(decodes)) if decodes else None
        layout = StepLayout(torch.cat(slot_mapping).to(dev), tuple(prefills), decode)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return layout, input_ids, torch.cat(positions).to(dev)

    def _decode_group(self, decodes: list[Chunk], slots: list[torch.Tensor], q_start: int) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        num_shared = self._shared_pages(decodes) if self.cascade and len(decodes) > 1 else 0
        shared = num_shared * bs
        own = [s[shared:] for s in slots]
        lengths = torch.tensor([len(s) for s in own])
        padded = torch.nn.utils.rnn.pad_sequence(own, batch_first=True)
        bias = _bias(torch.arange(padded.shape[1])[None, :] < lengths[:, None], self.dtype)
        shared_slots = slots[0][:shared].to(dev) if num_shared else None
        return DecodeGroup(q_start, padded.to(dev), bias[:, None, None, :].to(dev), shared_slots)

    def _shared_pages(self, decodes: list[Chunk]) -> int:
        """Leading pages that every decoding sequence holds (the same physical pages, so the same KV)."""
        tables = [c.seq.page_table for c in decodes]
        # Only pages wholly before each sequence's new token: the page being written into is never shared.
        limit = min(c.start // self.block_size for c in decodes)
        first = tables[0]
        count = 0
        while count < limit and all(t[count] == first[count] for t in tables):
            count += 1
        return count


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask (CPU SDPA is several times faster with these than with boolean masks)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
