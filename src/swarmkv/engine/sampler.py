"""Token selection for a batch: one argmax for every row, then one batched pass for the rows that sample."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy
import torch

from swarmkv.core.processors import RequestProcessor
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence as Request


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of float32 `logits` [N, vocab]; one host transfer for the whole batch."""
    return sample_on_device(logits, params, generators).tolist()


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """`sample`'s picks as int64 ids on the logits' device, without waiting for the device."""
    chosen = greedy_ids(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        index = to_device(torch.tensor(rows), device)
        picked = _sample_rows(logits[index], [params[i] for i in rows], [generators[i] for i in rows])
        chosen[index] = picked
    return chosen


class SeededSampling(RequestProcessor):
    """Seeded sampling as a per-request processor: a request with a seed draws from its own generator, so its
    draws do not depend on its batch neighbours; the others share the engine's."""

    def __init__(self, seed: int) -> None:
        self.shared = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def added(self, seq: Request) -> None:
        """A seeded request's own generator."""
        if seq.params.seed is not None:
            self._generators[seq.request_id] = torch.Generator().manual_seed(seq.params.seed)

    def ended(self, request_id: str) -> None:
        """Its generator goes."""
        self._generators.pop(request_id, None)

    def generator(self, request_id: str) -> torch.Generator:
        """The generator the request draws from."""
        return self._generators.get(request_id, self.shared)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum, a NaN before any number, as torch.argmax) as int64 on the logits'
    device. On the CPU through numpy: torch's argmax over [8, 49152] float32 took about 250 us on this 2-core
    machine against numpy's 24, a few percent of a batch-8 decode step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        picks = numpy.asarray(numpy.argmax(logits.detach().numpy(), axis=-1), dtype=numpy.int64)
        return torch.from_numpy(picks)
    return logits.argmax(dim=-1)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    # Every per-row setting, and one uniform draw from each request's own CPU generator (so a seeded
    # request does not depend on its batch neighbours), go to the device in one copy.
    settings = torch.tensor(
        [
            [*_settings(p, vocab), float(torch.rand((), generator=g))]
            for p, g in zip(params, generators, strict=True)
        ],
        dtype=torch.float64,
    )
    temperature, top_k, top_p, log_min_p, uniform = to_device(settings, device).unbind(-1)
    probs, order = _ranked_probs(logits, temperature, top_k, top_p, log_min_p)
    # Inverse CDF: the first rank whose cumulative mass passes u x (the kept mass).
    cdf = probs.cumsum(-1)
    target = (uniform.to(cdf.dtype) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True)
    # Kept tokens are a prefix of the ranking; rounding must not step past the last of them.
    picked = torch.minimum(picked, (probs > 0).sum(-1, keepdim=True) - 1)
    return order.gather(-1, picked).squeeze(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from for each row of `logits` [N, vocab] under one request's `params`
    (temperature, top-k, min-p, top-p applied), normalised, in vocabulary order."""
    n, vocab = logits.shape
    settings = torch.tensor([_settings(params, vocab)] * n, dtype=torch.float64)
    temperature, top_k, top_p, log_min_p = to_device(settings, logits.device).unbind(-1)
    probs, order = _ranked_probs(logits, temperature, top_k, top_p, log_min_p)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def _settings(params: SamplingParams, vocab: int) -> list[float]:
    """One row's temperature, top-k, top-p and log(min-p) (-inf: no floor), as `_ranked_probs` reads them."""
    log_min_p = math.log(params.min_p) if params.min_p > 0 else float("-inf")
    return [params.temperature, min(params.top_k or vocab, vocab), params.top_p, log_min_p]


def _ranked_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept probabilities in rank order (unnormalised once top-p cut them) and the ranking: top-k
    and min-p (p >= min_p x the top p, after temperature: a log-ratio against the top logit) keep a head of
    the ranking, and top-p cuts the distribution they leave, as vLLM orders them."""
    vocab = logits.shape[-1]
    ranked, order = (logits / temperature[:, None].to(logits.dtype)).sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    floor = ranked[:, :1] + log_min_p[:, None].to(ranked.dtype)
    ranked = ranked.masked_fill((rank[None, :] >= top_k[:, None]) | (ranked < floor), float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    # top-p keeps the smallest head whose mass reaches top_p; the most likely token always survives.
    probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None].to(probs.dtype), 0.0)
    return probs, order


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (through pinned memory on a GPU)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
