"""Drive the swarm workload over HTTP against any OpenAI-compatible server (swarmkv, vLLM, SGLang, llama.cpp).

Every agent runs concurrently, its turns back to back, each turn one streamed chat completion with the
workload's tools. Time to first token is measured at the client, from sending the request to the first
chunk that carries content or a tool call; cached tokens are whatever the server reports in
`usage.prompt_tokens_details.cached_tokens` (None when it reports nothing).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from swarmkv.errors import SwarmkvError
from swarmkv.swarm.workload import AgentScript, Message, Workload, initial_messages, tool_result_message

ProgressFn = Callable[[int, int], None]  # (turns done, turns in all)


class ServerError(SwarmkvError):
    """The server could not be reached, refused a request or broke off a stream."""


@dataclass
class TurnResult:
    """One chat completion of one agent; times in seconds from sending the request."""

    agent_id: str
    turn: int
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    num_chunks: int = 0  # chunks that carried content or tool calls

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one, from the server's completion token count."""
        n = self.completion_tokens
        if n is None or n < 2 or self.ttft_s is None or self.latency_s <= self.ttft_s:
            return None
        return (n - 1) / (self.latency_s - self.ttft_s)


def api_base(base_url: str) -> str:
    """`http://host:port`, with or without `/v1`, as the `.../v1` root the OpenAI routes live under."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def run_swarm_over_http(
    base_url: str,
    workload: Workload,
    model: str | None = None,
    api_key: str | None = None,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    per_slot: bool = False,
) -> dict[str, Any]:
    """Run every agent's turns against the server; the report has each turn and a summary. With `per_slot`,
    each agent sends its own `cache_salt`: it reuses its own earlier turns, never another agent's pages, as
    a per-slot server stores them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        per_agent, model, wall_s = await _run_agents(
            base_url, workload, model, headers, temperature, timeout_s, extra_body, progress, per_slot
        )
    except httpx.TransportError as exc:
        raise ServerError(f"cannot talk to {base_url}: {exc or type(exc).__name__}") from exc
    turns = [t for agent_turns in per_agent for t in agent_turns]
    return {
        "base_url": base_url,
        "model": model,
        "agents": len(workload.agents),
        "turns": workload.turns,
        "max_tokens": workload.max_tokens,
        "wall_s": round(wall_s, 4),
        "summary": summarize(turns, wall_s),
        "agent_turns": [[_turn_record(t) for t in agent_turns] for agent_turns in per_agent],
    }


async def _run_agents(
    base_url: str,
    workload: Workload,
    model: str | None,
    headers: dict[str, str],
    temperature: float,
    timeout_s: float,
    extra_body: dict[str, Any] | None,
    progress: ProgressFn | None,
    per_slot: bool,
) -> tuple[list[list[TurnResult]], str, float]:
    """Every agent's turns on one client: the turns, the model name used and the wall time."""
    limits = httpx.Limits(max_connections=len(workload.agents) + 2)
    async with httpx.AsyncClient(
        base_url=api_base(base_url), headers=headers, timeout=timeout_s, limits=limits
    ) as client:
        model = model or await _first_model(client)
        done = 0
        total = len(workload.agents) * workload.turns

        def turn_done() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)

        body = {"model": model, "temperature": temperature, **(extra_body or {})}
        start = time.perf_counter()
        per_agent = await asyncio.gather(
            *(
                _run_agent(
                    client,
                    workload,
                    agent,
                    {**body, "cache_salt": agent.agent_id} if per_slot else body,
                    turn_done,
                )
                for agent in workload.agents
            )
        )
        wall_s = time.perf_counter() - start
    return per_agent, model, wall_s


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/models")
    if response.status_code != 200:
        raise ServerError(f"GET /models answered {response.status_code}: {response.text[:500]}")
    data = response.json().get("data") or []
    if not data:
        raise ServerError("the server lists no models; pass the model name")
    return str(data[0]["id"])


async def _run_agent(
    client: httpx.AsyncClient,
    workload: Workload,
    agent: AgentScript,
    body: dict[str, Any],
    turn_done: Callable[[], None],
) -> list[TurnResult]:
    messages = initial_messages(workload, agent)
    results = []
    for turn in range(workload.turns):
        request = {
            **body,
            "messages": messages,
            "tools": list(workload.tools),
            "max_tokens": workload.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = await stream_chat(client, request, TurnResult(agent.agent_id, turn))
        results.append(result)
        turn_done()
        reply: Message = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            reply["tool_calls"] = result.tool_calls
        messages = [*messages, reply]
        if turn + 1 < workload.turns:
            messages.append(tool_result_message(agent, turn))
    return results


async def stream_chat(client: httpx.AsyncClient, request: dict[str, Any], result: TurnResult) -> TurnResult:
    """Send one streamed chat completion and fill `result` from its chunks."""
    calls: dict[int, dict[str, Any]] = {}
    texts: list[str] = []
    start = time.perf_counter()
    async with client.stream("POST", "/chat/completions", json=request) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise ServerError(f"POST /chat/completions answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"the stream broke off: {chunk['error']}")
            if chunk.get("usage"):
                _read_usage(chunk["usage"], result)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    result.num_chunks += 1
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                texts.append(delta.get("content") or "")
                for piece in delta.get("tool_calls") or []:
                    _merge_call(calls.setdefault(piece.get("index", 0), {}), piece)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    result.latency_s = time.perf_counter() - start
    result.text = "".join(texts)
    result.tool_calls = [calls[i] for i in sorted(calls)]
    return result


def _read_usage(usage: dict[str, Any], result: TurnResult) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


def _merge_call(call: dict[str, Any], piece: dict[str, Any]) -> None:
    """Accumulate a streamed tool-call fragment the way OpenAI clients do."""
    if piece.get("id"):
        call["id"] = piece["id"]
    call["type"] = "function"
    function = call.setdefault("function", {"name": "", "arguments": ""})
    fragment = piece.get("function") or {}
    function["name"] += fragment.get("name") or ""
    function["arguments"] += fragment.get("arguments") or ""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(turns: list[TurnResult], wall_s: float) -> dict[str, Any]:
    """Time to first token percentiles, throughput and what the server says it served from cache."""
    ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
    first = [t.ttft_s for t in turns if t.ttft_s is not None and t.turn == 0]
    later = [t.ttft_s for t in turns if t.ttft_s is not None and t.turn > 0]
    rates = [r for t in turns if (r := t.decode_tokens_per_s) is not None]
    completion = sum(t.completion_tokens or 0 for t in turns)
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    reported = [t.cached_tokens for t in turns if t.cached_tokens is not None]
    cached = sum(reported) if reported else None
    return {
        "requests": len(turns),
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p95_s": _round(percentile(ttfts, 95)),
        "ttft_first_turn_p50_s": _round(percentile(first, 50)),
        "ttft_later_turns_p50_s": _round(percentile(later, 50)),
        "decode_tokens_per_s_p50": _round(percentile(rates, 50)),
        "output_tokens_per_s": _round(completion / wall_s if wall_s else math.nan),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cached_fraction": _round(cached / prompt) if cached is not None and prompt else None,
    }


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _turn_record(t: TurnResult) -> dict[str, Any]:
    record = asdict(t)
    record["decode_tokens_per_s"] = _round(t.decode_tokens_per_s or math.nan)
    for key in ("ttft_s", "latency_s"):
        if record[key] is not None:
            record[key] = round(record[key], 4)
    return record
