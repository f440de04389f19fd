"""Where cascade decode attention starts to pay: one decode group, its shared prefix read once or per row.

Run: .venv/bin/python bench/cascade.py [--agents 2,4,8 --shared 16,64,256,512,1024,2048 --own 64]
Times the attention of one layer of the default model's shape (SmolLM2-135M: 9 query heads, 3 KV heads of
64, float32) for a group of decodes that share `shared` tokens and each own `own` more, with the shared
part read once (cascade) or once per row (plain paged decode). The ratio plain / cascade above 1 means
cascade wins. `AUTO_MIN_SAVED_TOKENS` in swarmkv/engine/cascade.py is set from this table.
"""

from __future__ import annotations

import argparse
import time

import torch

from swarmkv.config import ModelConfig
from swarmkv.engine.cascade import AUTO_MIN_SAVED_TOKENS
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, StepLayout
from swarmkv.models.default import default_model_path
from swarmkv.models.gguf_file import read_gguf_metadata

PAGE = 16


def group(agents: int, shared: int, own: int, cascade: bool) -> DecodeGroup:
    """Slots of a group: pages [0, shared/PAGE) common to all, then each row's own pages."""
    shared_slots = torch.arange(shared)
    own_slots = torch.stack([shared + a * own + torch.arange(own) for a in range(agents)])
    if cascade:
        bias = torch.zeros(agents, 1, 1, own)
        return DecodeGroup(0, own_slots, bias, shared_slots)
    full = torch.cat([shared_slots.expand(agents, -1), own_slots], dim=1)
    return DecodeGroup(0, full, torch.zeros(agents, 1, 1, shared + own), None)


def time_s(backend: PagedAttention, q: torch.Tensor, g: DecodeGroup, repeats: int) -> float:
    """Best of `repeats` timings of one layer's decode attention."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        backend._decode(0, q, g)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", default="2,4,8")
    parser.add_argument("--shared", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--own", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    config = ModelConfig.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    agents_list = [int(a) for a in args.agents.split(",")]
    shared_list = [int(s) for s in args.shared.split(",")]
    slots = max(shared_list) + max(agents_list) * args.own
    cache = KVCache(config, -(-slots // PAGE), PAGE, torch.float32, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    backend = PagedAttention(cache, StepLayout(torch.zeros(0, dtype=torch.int64), (), ()))
    print(
        f"{'agents':>6} {'shared':>7} {'saved':>7} {'plain us':>9} {'cascade us':>11} {'plain/cascade':>14} auto"
    )
    for agents in agents_list:
        q = torch.randn(agents, config.num_heads, config.head_dim)
        for shared in shared_list:
            plain = time_s(backend, q, group(agents, shared, args.own, False), args.repeats)
            cascade = time_s(backend, q, group(agents, shared, args.own, True), args.repeats)
            saved = (agents - 1) * shared
            auto = "cascade" if saved >= AUTO_MIN_SAVED_TOKENS else "plain"
            print(
                f"{agents:6} {shared:7} {saved:7} {plain * 1e6:9.0f} {cascade * 1e6:11.0f} "
                f"{plain / cascade:13.2f}x {auto}"
            )


if __name__ == "__main__":
    main()
