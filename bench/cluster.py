"""Routing policies on a 2-replica Ray Serve cluster on this machine, against one replica on the same trace.

Several swarms of agents, each swarm with its own long head (system prompt), each agent a multi-turn session
(X-Session-Id) whose history grows by a fixed reply and tool result per turn; a turn's requests from every
agent arrive together (in a shuffled order), so each swarm starts cold. The same trace runs once per policy
(prefix, session, round-robin, Ray Serve's PrefixCacheAffinityRouter), each on a freshly deployed cluster,
plus a single replica as the reference, holding the cluster's total KV. The pools are sized so that a
replica holds its share of the swarms but not all of them: the regime where one card no longer fits the team.
Figures come from each response's usage (prompt and cached tokens) and its replica header; TTFT is the
time to the first streamed content.

    .venv/bin/python bench/cluster.py [--swarms 4 --agents 4 --turns 5 --head-words 1500 --kv-mib 16]

The model is a tiny random Qwen3 (tests/tiny_models.py): routing and caching do not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from swarmkv.cluster.config import ClusterConfig, RouterName  # noqa: E402
from swarmkv.cluster.forward import REPLICA_HEADER  # noqa: E402
from swarmkv.cluster.ray_app import APP_NAME, build_app  # noqa: E402
from swarmkv.swarm.http_driver import percentile  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

RUNS: tuple[tuple[str, int, RouterName], ...] = (
    ("single replica", 1, "round-robin"),
    ("round-robin", 2, "round-robin"),
    ("session", 2, "session"),
    ("prefix", 2, "prefix"),
    ("ray PrefixCacheAffinity", 2, "ray-prefix"),
)


@dataclass(frozen=True)
class Sample:
    """One request's outcome."""

    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def trace(
    swarms: int, agents: int, turns: int, head_words: int, tool_words: int
) -> list[list[tuple[str, list[dict[str, str]]]]]:
    """Per turn, every agent's (session, messages), in a seeded random order: agents' tool calls return in
    no fixed order (in lock-step, round-robin would send each agent to the same replica every turn)."""
    rng = random.Random(0)
    rounds = []
    for turn in range(turns):
        batch = []
        for s in range(swarms):
            head = f"You are agent of swarm {s}. " + " ".join(f"rule{s}x{i % 211}" for i in range(head_words))
            for a in range(agents):
                messages = [{"role": "system", "content": head}, {"role": "user", "content": f"task {s}.{a}"}]
                for t in range(turn):
                    messages.append({"role": "assistant", "content": f"calling tool step {t} for {s}.{a}"})
                    result = " ".join(f"out{s}.{a}.{t}.{i}" for i in range(tool_words))
                    messages.append({"role": "user", "content": f"tool result: {result}"})
                batch.append((f"s{s}-a{a}", messages))
        rng.shuffle(batch)
        rounds.append(batch)
    return rounds


def send(url: str, session: str, messages: list[dict[str, str]]) -> Sample:
    """One streamed chat request: its replica, usage and time to first content."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft_s, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                      timeout=300) as response:  # fmt: skip
        replica = response.headers[REPLICA_HEADER]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft_s is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft_s = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    assert usage is not None, "no usage chunk"
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Sample(replica, usage["prompt_tokens"], cached, ttft_s or time.perf_counter() - start)


def run_policy(
    model: Path, replicas: int, router: RouterName, kv_bytes: int, url: str, rounds: list[Any]
) -> list[Sample]:
    """Deploy a fresh cluster with this policy and replay the trace, a turn at a time."""
    config = ClusterConfig(
        replicas=replicas,
        router=router,
        model_kwargs={"model": str(model)},
        engine_kwargs={"kv_cache_memory": kv_bytes, "max_model_len": 16384},
        torch_threads=1,
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    samples: list[Sample] = []
    with ThreadPoolExecutor(32) as pool:
        for batch in rounds:
            samples += pool.map(lambda job: send(url, *job), batch)
    serve.delete(APP_NAME)
    return samples


def _ratio(value: int, baseline: int | None) -> str:
    return f"{value / baseline:.2f}" if baseline else "n/a"


def report(results: dict[str, list[Sample]]) -> str:
    """The table: hit rate, prefill computed (and against round-robin), TTFT, requests per replica."""
    computed = {
        name: sum(s.prompt_tokens - s.cached_tokens for s in samples) for name, samples in results.items()
    }
    baseline = computed.get("round-robin")  # None when its run failed: no ratios then
    lines = [
        f"{'policy':<26}{'hit rate':>9}{'prefill computed':>18}{'vs RR':>7}{'TTFT p50':>10}{'TTFT p95':>10}"
        "  requests per replica",
    ]
    for name, samples in results.items():
        prompt = sum(s.prompt_tokens for s in samples)
        hit = sum(s.cached_tokens for s in samples) / prompt
        ttfts = [s.ttft_s for s in samples]
        per = sorted(Counter(s.replica for s in samples).values(), reverse=True)
        lines.append(
            f"{name:<26}{hit:>9.1%}{computed[name]:>18,}{_ratio(computed[name], baseline):>7}"
            f"{statistics.median(ttfts) * 1000:>8.0f}ms{percentile(ttfts, 95) * 1000:>8.0f}ms  {per}"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every policy on the same trace and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--swarms", type=int, default=4)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--head-words", type=int, default=1500, help="words in each swarm's head")
    parser.add_argument("--tool-words", type=int, default=30, help="words in each tool result")
    parser.add_argument(
        "--kv-mib",
        type=int,
        default=16,
        help="KV pool per cluster replica (the single replica gets the cluster's total: 2x this)",
    )
    args = parser.parse_args()
    rounds = trace(args.swarms, args.agents, args.turns, args.head_words, args.tool_words)
    results: dict[str, list[Sample]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny", "qwen3", max_position_embeddings=16384)
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        try:
            for name, replicas, router in RUNS:
                start = time.perf_counter()
                try:
                    kv_bytes = args.kv_mib * 1024**2 * (2 if replicas == 1 else 1)
                    results[name] = run_policy(model, replicas, router, kv_bytes, url, rounds)
                except Exception as exc:  # Ray's router is optional: say why it could not run
                    print(f"{name}: could not run: {type(exc).__name__}: {exc}", flush=True)
                    continue
                print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    n = sum(len(b) for b in rounds)
    print(
        f"\n{args.swarms} swarms x {args.agents} agents x {args.turns} turns = {n} requests; 2 replicas with "
        f"{args.kv_mib} MiB of KV each, the single replica with {2 * args.kv_mib} MiB"
    )
    print(report(results))


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
