"""Token selection for a batch: one argmax for every row, then one batched pass for the rows that sample."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmkv.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of float32 `logits` [N, vocab]; one host transfer for the whole batch."""
    chosen = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        index = torch.tensor(rows, device=device)
        picked = _sample_rows(logits[index], [params[i] for i in rows], [generators[i] for i in rows])
        chosen[index] = picked
    return chosen.tolist()


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    ranked, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)  # any int fits
    ranked = ranked.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    # top-p keeps the smallest head whose mass reaches top_p; the most likely token always survives.
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without normalising it. The noise comes
    # from each request's own CPU generator, so seeded requests do not depend on their batch neighbours.
    noise = torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators]).to(device)
    return order.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
