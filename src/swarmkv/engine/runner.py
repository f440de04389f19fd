"""ModelRunner: turn a step's chunks into one flat batch, run the model over paged KV, return logits."""

from __future__ import annotations

import torch

from swarmkv.engine.kv_cache import KVCache, page_slots
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, PrefillSpan, StepLayout
from swarmkv.engine.scheduler import Chunk
from swarmkv.models.decoder import DecoderForCausalLM


class ModelRunner:
    """Owns the KV tensors and runs the model; knows nothing about queues or sampling."""

    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
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
        decode = None
        if decode_slots:
            lengths = torch.tensor([len(s) for s in decode_slots])
            padded = torch.nn.utils.rnn.pad_sequence(decode_slots, batch_first=True)
            bias = _bias(torch.arange(padded.shape[1])[None, :] < lengths[:, None], self.dtype)
            decode = DecodeGroup(row - len(decode_slots), padded.to(dev), bias[:, None, None, :].to(dev))
        layout = StepLayout(torch.cat(slot_mapping).to(dev), tuple(prefills), decode)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return layout, input_ids, torch.cat(positions).to(dev)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask (CPU SDPA is several times faster with these than with boolean masks)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
