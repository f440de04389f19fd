"""Verifying a draft against the model's own logits: the tokens a speculative chunk yields.

A chunk that computed a request's last token and `k` draft tokens after it has `k + 1` rows of logits: row i
is the model's distribution after draft token i (row 0 after the last token). Greedy requests keep the draft
while it is the argmax and then take the argmax, so the reply is token-identical to decoding without drafts.
Sampling requests keep the target distribution by rejection sampling of a deterministic draft (the draft's
distribution q is one-hot): draft token i is accepted with probability p_i(token); on a rejection the next
token comes from p_i with that token removed (max(p - q, 0), renormalised); after a fully accepted draft one
more comes from the last row. Either way at least one token comes out, so a step never yields less than a
decode would.
"""

from __future__ import annotations

import torch

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.sampler import probabilities


def verify_greedy(choices: list[int], draft: tuple[int, ...]) -> list[int]:
    """The tokens a greedy draft yields, from each row's argmax (`choices`, one more than the draft)."""
    accepted = 0
    while accepted < len(draft) and choices[accepted] == draft[accepted]:
        accepted += 1
    return [*draft[:accepted], choices[accepted]]


def verify_sampled(
    logits: torch.Tensor, draft: tuple[int, ...], params: SamplingParams, generator: torch.Generator
) -> list[int]:
    """The tokens a sampling request's draft yields, from its `len(draft) + 1` rows of float32 logits."""
    probs = probabilities(logits, params).cpu().double()
    out: list[int] = []
    for i, token in enumerate(draft):
        row = probs[i]
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(row[token]):
            out.append(token)
            continue
        residual = row.clone()
        residual[token] = 0.0
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(draft)], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn in proportion to `weights` (float64, on the host, not all zero)."""
    cdf = weights.cumsum(0)
    target = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    # Rounding must not step past the last token with any weight.
    return min(index, int(weights.nonzero()[-1]))
