"""The MTP layer's drafts, run after each step on the rows the step computed.

The layer's KV at position p is computed from the decoder's hidden state at p and the token at p + 1, so it
lags the decoder's by one: after a step, every row whose next token is now known (a prefill chunk's rows,
each decode's accepted positions and its new token) goes through the layer once, which writes its KV in the
request's own pages (the layer's slab, after the decoder's) and, on each request's last row, gives the first
draft token. Further draft tokens chain the layer on its own normed output at the positions after; their keys
and values stay in memory beside what the slab holds (their positions are not the request's yet), so drafting
writes nothing it could leave behind. A request whose drafts are skipped (the chooser backing off) still has
its rows' KV written, which costs the layer, not the LM head. KV the layer reads is only ever a draft's input:
verification decides every token, so a slab position written by a different continuation (a rejected draft's
page reused) costs acceptance, never correctness. For the same reason the layer's projections and the drafts'
LM head passes multiply int8 activations on the CPU where the kernels read the file's blocks so
(`Int8Draft`): several times faster than float32 activations on a few rows, and a draft token at most changes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import PROVISIONAL_TOKEN
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.paged_attention import PagedAttention, build_layout
from swarmkv.kernels import cpu_grouped
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.gguf_linear import GGUFLinear, dequantize_block
from swarmkv.models.gguf_quants import GroupedQuant
from swarmkv.spec.chooser import DraftChooser


@dataclass(frozen=True)
class _Rows:
    """One chunk's rows whose next token is known: their hidden states' rows in the step, and those tokens."""

    chunk: Chunk
    first_row: int
    next_tokens: list[int]


class MTPDrafter:
    """Runs the model's MTP layer after each step and hands the chooser each request's draft."""

    def __init__(
        self, model: DecoderForCausalLM, kv: KVCache, page_table: PageTable, chooser: DraftChooser
    ) -> None:
        assert model.mtp is not None, "a model without an MTP layer drafts from text only"
        self.model, self.mtp = model, model.mtp
        self.kv, self.page_table, self.chooser = kv, page_table, chooser
        Int8Draft.wrap(self.mtp)
        head = model.lm_head
        self.head = Int8Draft(head) if isinstance(head, GGUFLinear) and Int8Draft.reads(head) else head

    @torch.inference_mode()
    def after_step(
        self,
        chunks: list[Chunk],
        hidden: torch.Tensor,
        accepted: dict[str, list[int]],
        step_s: float,
    ) -> None:
        """`chunks` in the order of their rows of `hidden` (every row the step computed); `accepted`: each
        sampling chunk's ids (its accepted draft tokens, then the new one). `step_s`: the step's time, against
        which the LM head's passes are weighed."""
        items: list[_Rows] = []
        first = 0
        for chunk in chunks:
            rows = self._rows(chunk, first, accepted.get(chunk.request_id))
            first += chunk.num_tokens
            if rows is not None and (not chunk.samples or self.chooser.keeps_kv(chunk.request_id)):
                items.append(rows)
        if not items:
            return
        out = self._catch_up(items, hidden)
        # Each item's last row in `out`, and how many tokens its request drafts (0: none).
        lasts = [end - 1 for end in itertools.accumulate(len(r.next_tokens) for r in items)]
        lengths = [self.chooser.mtp_length(r.chunk.request_id) if r.chunk.samples else 0 for r in items]
        drafting = [(r, n) for r, n in zip(items, lengths, strict=True) if n]
        if not drafting:
            return
        start = time.perf_counter()
        states = out[torch.tensor([last for last, n in zip(lasts, lengths, strict=True) if n])]
        drafts = self._chain(drafting, states)
        for (r, _), tokens in zip(drafting, drafts, strict=True):
            self.chooser.set_proposal(r.chunk.request_id, tokens)
        passes = max(n for _, n in drafting)
        self.chooser.observe_cost((time.perf_counter() - start) / passes, step_s)

    def _rows(self, chunk: Chunk, first: int, accepted: list[int] | None) -> _Rows | None:
        """The chunk's rows whose next token is known now, or None (no row: a sampling chunk's new token went
        unread, as under async scheduling)."""
        computed = chunk.num_tokens - len(chunk.draft)  # the positions that were the request's own
        if chunk.samples:
            if accepted is None:
                return None
            # The chunk's own positions, then its accepted drafts: each row's next token follows it.
            next_tokens = chunk.token_ids[1:computed] + accepted
        else:
            seq_tokens = chunk.seq.token_ids
            end = chunk.start + chunk.num_tokens
            next_tokens = chunk.token_ids[1:] + [seq_tokens[end]]
        if PROVISIONAL_TOKEN in next_tokens:
            return None
        return _Rows(chunk, first, next_tokens)

    def _catch_up(self, items: list[_Rows], hidden: torch.Tensor) -> torch.Tensor:
        """The layer over every item's rows, writing their KV: its normed output, one row per input row."""
        rows = torch.cat([torch.arange(r.first_row, r.first_row + len(r.next_tokens)) for r in items])
        pseudo = [
            Chunk(r.chunk.seq, r.chunk.start, r.next_tokens, "prefill", False) for r in items
        ]  # each item's rows as a prefill chunk over its earlier positions
        layout, input_ids, positions = build_layout(self.page_table, pseudo, [], [], self.kv.dtype)
        embeds = self.model.embed_tokens(input_ids)
        h = hidden[rows.to(hidden.device)].to(embeds.dtype)
        return self.mtp(embeds, h, positions, PagedAttention(self.kv, layout))

    def _chain(self, drafting: list[tuple[_Rows, int]], states: torch.Tensor) -> list[list[int]]:
        """Each drafting request's tokens: the LM head on its last row's output, then the layer chained on its
        own output at the positions after, up to its length."""
        drafts: list[list[int]] = [[] for _ in drafting]
        live = list(range(len(drafting)))
        backend = _ChainAttention(
            self.kv,
            self.page_table,
            [self.page_table.row(r.chunk.request_id) for r, _ in drafting],
            [r.chunk.start + len(r.next_tokens) for r, _ in drafting],
        )
        step = 0
        while live:
            tokens = self.head(states).argmax(dim=-1).tolist()
            for i, token in zip(live, tokens, strict=True):
                drafts[i].append(token)
            live_next = [j for j, i in enumerate(live) if len(drafts[i]) < drafting[i][1]]
            if not live_next:
                break
            live = [live[j] for j in live_next]
            keep = torch.tensor(live_next)
            ids = torch.tensor([drafts[i][-1] for i in live], device=states.device)
            positions = torch.tensor(
                [backend.context[i] + step for i in live], dtype=torch.int64, device=states.device
            )
            backend.rows = live
            states = self.mtp(self.model.embed_tokens(ids), states[keep], positions, backend)
            step += 1
        return drafts


class _ChainAttention:
    """Attention for chained draft rows: each attends over its request's slab positions before `context` and
    the chained rows before it, kept here, never stored."""

    def __init__(self, kv: KVCache, table: PageTable, table_rows: list[int], context: list[int]) -> None:
        self.kv, self.table = kv, table
        self.table_rows, self.context = table_rows, context
        self.rows: list[int] = []  # which drafting requests this pass's rows are, in order
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for n, i in enumerate(self.rows):
            slots = self.table.context_slots(torch.tensor([self.table_rows[i]]), self.context[i])[0]
            past_k, past_v = self.kv.gather(layer, slots)
            own_k, own_v = self._own.get(i, (k[:0], v[:0]))
            own_k, own_v = torch.cat([own_k, k[n : n + 1]]), torch.cat([own_v, v[n : n + 1]])
            self._own[i] = (own_k, own_v)
            keys, values = torch.cat([past_k.to(k.dtype), own_k]), torch.cat([past_v.to(v.dtype), own_v])
            attn = F.scaled_dot_product_attention(
                q[n : n + 1].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                enable_gqa=True,
            )
            out[n] = attn[0, :, 0]
        return out


class Int8Draft(torch.nn.Module):
    """A GGUF-held projection as the drafts run it on the CPU: each block of the file's bits on int8
    activations (`cpu_grouped.matmul_int8`), a float block through the layer's own matmul."""

    def __init__(self, linear: GGUFLinear) -> None:
        super().__init__()
        self.linear = linear

    @staticmethod
    def reads(linear: GGUFLinear) -> bool:
        """Whether the layer is held on the CPU, where the int8 kernels read some block of it."""
        blocks = [b.weight for b in linear.blocks]
        quantized = [w for w in blocks if isinstance(w, GroupedQuant)]
        on_cpu = all(w.low.device.type == "cpu" for w in quantized) and cpu_grouped.available()
        return on_cpu and any(cpu_grouped.reads_int8(w) for w in quantized)

    @staticmethod
    def wrap(module: torch.nn.Module) -> None:
        """Put every GGUF-held projection under `module` that the int8 kernels read behind an Int8Draft."""
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Draft):
                continue  # wrapped by an earlier engine over the same model
            if isinstance(child, GGUFLinear):
                if Int8Draft.reads(child):
                    setattr(module, name, Int8Draft(child))
            else:
                Int8Draft.wrap(child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        flat = x.reshape(-1, linear.in_features).float().contiguous()
        out = torch.empty(flat.shape[0], linear.out_features, dtype=torch.float32)
        for block in linear.blocks:
            w = block.weight
            if isinstance(w, GroupedQuant) and cpu_grouped.reads_int8(w):
                out[:, block.start : block.start + block.rows] = cpu_grouped.matmul_int8(flat, w)
            else:
                out[:, block.start : block.start + block.rows] = flat @ dequantize_block(w).T
        if linear.bias is not None:
            out += linear.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], linear.out_features)
