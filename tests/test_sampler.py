"""The batched sampler draws from the filtered distribution it claims to."""

from __future__ import annotations

from collections import Counter

import torch

from swarmkv import SamplingParams
from swarmkv.engine.sampler import greedy_ids, sample

PROBS = torch.tensor([0.5, 0.3, 0.2])


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> Counter[int]:
    logits = PROBS.log().repeat(n, 1)
    gens = [torch.Generator().manual_seed(seed * n + i) for i in range(n)]
    return Counter(sample(logits, [params] * n, gens))  # type: ignore[arg-type]


def test_frequencies_follow_the_softmax() -> None:
    counts = draw(SamplingParams(temperature=1.0))
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_and_top_p_cut_the_tail() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.6))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5))) == {0}


def test_greedy_rows_and_sampled_rows_mix_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    assert sample(logits, params, [None, torch.Generator().manual_seed(1)]) == [1, 0]


def test_greedy_ids_pick_what_torch_argmax_picks() -> None:
    """The CPU's numpy argmax: the first maximum, a NaN before any number, on views too."""
    logits = torch.randn(6, 4000, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 9]] = float("nan")
    logits[2] = 1.0
    logits[3, [10, 20]] = 50.0
    logits[4, 5] = float("inf")
    for view in (logits, logits[:, 1::3], logits.t().contiguous().t(), logits[2], logits[1]):
        assert torch.equal(greedy_ids(view), view.argmax(-1))
        assert greedy_ids(view).dtype == torch.int64
