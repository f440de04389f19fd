"""The paged and cascade attention paths against dense attention written out by hand."""

from __future__ import annotations

import torch

from engine_helpers import tiny_config
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, StepLayout

BLOCK = 4
CONFIG = tiny_config(num_layers=1)


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] against k, v [L, Hkv, D]: softmax(q k^T / sqrt(D)) v, heads grouped."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def test_cascade_decode_equals_dense_attention() -> None:
    torch.manual_seed(0)
    cache = KVCache(CONFIG, num_pages=32, block_size=BLOCK, dtype=torch.float64, device=torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    shared_pages = [3, 7, 1]
    tables = [shared_pages + [10, 11], shared_pages + [20], shared_pages + [25, 26, 27]]
    lengths = [19, 13, 24]  # tokens already in the cache, the decoded one included
    table = PageTable(len(tables), 8, BLOCK, torch.device("cpu"))
    for i, pages in enumerate(tables):
        table.append(f"r{i}", pages)
    slots = [table.context_slots(torch.tensor([table.row(f"r{i}")]), n)[0] for i, n in enumerate(lengths)]
    q = torch.randn(3, CONFIG.num_heads, CONFIG.head_dim, dtype=torch.float64)
    shared = len(shared_pages) * BLOCK
    own = torch.nn.utils.rnn.pad_sequence([s[shared:] for s in slots], batch_first=True)
    own_len = torch.tensor([len(s) - shared for s in slots])
    bias = torch.zeros(own.shape, dtype=torch.float64).masked_fill_(
        torch.arange(own.shape[1])[None] >= own_len[:, None], float("-inf")
    )
    group = DecodeGroup(0, own, bias[:, None, None, :], slots[0][:shared])
    backend = PagedAttention(cache, StepLayout(torch.zeros(0, dtype=torch.int64), (), (group,)))
    got = backend._cascade_decode(0, q, group)
    for i, s in enumerate(slots):
        want = dense_decode(q[i], cache.k[0][s], cache.v[0][s])
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-10)
