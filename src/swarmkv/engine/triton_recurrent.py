"""A hybrid step on the triton backend: attention goes to TritonAttention, and linear-attention layers run
Triton kernels that read each sequence's state from its slot and write it back in place, the slots taken
from the step's device metadata. So a decode step launches the same kernels whatever its slots, and is
captured whole in a CUDA graph; the torch twin is `RecurrentStep`."""

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
    ) -> None:
        """`prefill_tokens`: the step's prefill chunks' lengths (its first sequences), known on the host.
        `chunked_prefill`: prefill chunks through fla's chunked kernel (GPUs), else token by token."""
        self.attention = attention
        self.states = states
        self.meta = meta
        self.prefill_tokens = prefill_tokens
        # fla's kernels take the prefill chunks' boundaries on the host too: no copy back mid-forward.
        self.prefill_starts_host: torch.Tensor | None = None
        if chunked_prefill and prefill_tokens:
            ends = torch.tensor(prefill_tokens, dtype=torch.int64).cumsum(0)
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
        decode step, a second for the windows where prefill chunks spread over programs)."""
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
        """The gated delta rule: decodes (and, without chunking, prefills) by the recurrent kernel, prefill
        chunks by fla's chunked kernel where `chunked_prefill`."""
        states, starts, slots = self.states.ssm[layer], self.meta.state_starts, self.meta.state_slots
        if self.prefill_starts_host is None:
            return gated_delta.gated_delta_recurrent(q, k, v, g, beta, states, starts, slots)
        num_prefills, num_rows = len(self.prefill_tokens), sum(self.prefill_tokens)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if slots.shape[0] > num_prefills:  # the decodes, on rows past the prefills'
            gated_delta.gated_delta_recurrent(
                q, k, v, g, beta, states, starts[num_prefills:], slots[num_prefills:], out=out
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
