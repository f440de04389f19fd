"""A hybrid step on the triton backend: attention goes to TritonAttention, and linear-attention layers run
Triton kernels that read each sequence's state from its slot and write it back in place, the slots taken
from the step's device metadata. So a decode step launches the same kernels whatever its slots, and is
captured whole in a CUDA graph; the torch twin is `RecurrentStep`.

A speculative chunk (a request's last token and its draft; the step's last prefill chunks, never graphed)
runs through the recurrent kernels, never fla's chunked one, which also write the state after each of its
positions to a buffer the `StateCache` keeps, so the engine can rewind the slot to the last accepted one."""

from __future__ import annotations

import torch

from swarmkv.engine.state_cache import StateCache
from swarmkv.engine.triton_attention import StepMetadata, TritonAttention
from swarmkv.kernels import gated_delta
from swarmkv.models.attention import KVSlabs


class TritonRecurrentStep:
    """An AttentionBackend and RecurrentBackend for one step of the triton runner."""

    def __init__(
        self,
        attention: TritonAttention,
        states: StateCache,
        meta: StepMetadata,
        prefill_tokens: tuple[int, ...],
        chunked_prefill: bool,
        speculative_slots: tuple[int, ...] = (),
    ) -> None:
        """`prefill_tokens`: the step's prefill chunks' lengths (its first sequences), known on the host.
        `chunked_prefill`: prefill chunks through fla's chunked kernel (GPUs), else token by token.
        `speculative_slots`: the state slots of the speculative chunks, the last of the prefill chunks."""
        self.attention = attention
        self.states = states
        self.meta = meta
        self.prefill_tokens = prefill_tokens
        self.speculative_slots = speculative_slots
        self.num_plain = len(prefill_tokens) - len(speculative_slots)  # prefill chunks without a draft
        # The speculative chunks' rows, [first, end) of the flat batch, after the plain prefills'.
        self.kept_rows = (sum(prefill_tokens[: self.num_plain]), sum(prefill_tokens))
        states.begin_positions(list(speculative_slots))
        # fla's kernels take the plain prefill chunks' boundaries on the host too: no copy back mid-forward.
        self.prefill_starts_host: torch.Tensor | None = None
        if chunked_prefill and self.num_plain:
            ends = torch.tensor(prefill_tokens[: self.num_plain], dtype=torch.int64).cumsum(0)
            self.prefill_starts_host = torch.cat([ends.new_zeros(1), ends])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention layers: TritonAttention's business."""
        return self.attention.attend(layer, q, k, v)

    def kv_slabs(self, layer: int) -> KVSlabs:
        """Attention layers store their own K and V, fused with the rotary (models/attention.StoresKV)."""
        return self.attention.kv_slabs(layer)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention over the K and V the layer stored: TritonAttention's business."""
        return self.attention.attend_stored(layer, q)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The causal conv of every sequence's new inputs, windows updated in their slots (one launch for a
        decode step, a second for the windows where prefill chunks spread over programs); a speculative
        chunk's window after each position is kept first, from the windows before the update."""
        if self.speculative_slots:
            first, end = self.kept_rows
            speculative = slice(self.num_plain, len(self.prefill_tokens))
            kept = gated_delta.conv_positions(
                x,
                self.states.conv[layer],
                self.meta.state_starts[speculative.start : speculative.stop + 1],
                self.meta.state_slots[speculative],
                end - first,
            )
            for slot, rows in self._speculative_rows():
                self.states.keep_positions(layer, slot, conv=kept[rows])
        return gated_delta.causal_conv(
            x,
            self.states.conv[layer],
            weight,
            self.meta.state_starts,
            self.meta.state_slots,
            max(self.prefill_tokens, default=1),
        )

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule: decodes, speculative chunks (keeping the state after each position) and,
        without chunking, prefills by the recurrent kernel; plain prefill chunks by fla's chunked kernel
        where `chunked_prefill`."""
        states, starts, slots = self.states.ssm[layer], self.meta.state_starts, self.meta.state_slots
        first, end = self.kept_rows
        kept = states.new_empty((end - first, *states.shape[1:])) if self.speculative_slots else None
        if self.prefill_starts_host is None:
            out = gated_delta.gated_delta_recurrent(
                q, k, v, g, beta, states, starts, slots, kept=kept, kept_from=first
            )
        else:
            out = self._chunked_delta_rule(q, k, v, g, beta, states, kept)
        if kept is not None:
            for slot, rows in self._speculative_rows():
                self.states.keep_positions(layer, slot, ssm=list(kept[rows].unbind(0)))
        return out

    def _chunked_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """The plain prefill chunks through fla's chunked kernel, the speculative chunks and decodes on the
        rows past theirs through the recurrent one."""
        assert self.prefill_starts_host is not None
        starts, slots = self.meta.state_starts, self.meta.state_slots
        num_prefills, num_rows = self.num_plain, self.kept_rows[0]
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if slots.shape[0] > num_prefills:
            gated_delta.gated_delta_recurrent(
                q,
                k,
                v,
                g,
                beta,
                states,
                starts[num_prefills:],
                slots[num_prefills:],
                out=out,
                kept=kept,
                kept_from=num_rows,
            )
        rows = slice(0, num_rows)
        out[rows] = gated_delta.chunked_gated_delta(
            q[rows],
            k[rows],
            v[rows],
            g[rows],
            beta[rows],
            states,
            starts[: num_prefills + 1],
            self.prefill_starts_host,
            slots[:num_prefills],
        )
        return out

    def _speculative_rows(self) -> list[tuple[int, slice]]:
        """Each speculative chunk's slot and its rows of the step's kept states."""
        spans, row = [], 0
        for slot, num_tokens in zip(
            self.speculative_slots, self.prefill_tokens[self.num_plain :], strict=True
        ):
            spans.append((slot, slice(row, row + num_tokens)))
            row += num_tokens
        return spans
