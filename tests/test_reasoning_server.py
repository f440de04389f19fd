"""A thinking model served: `<think>` reasoning in each API's own field, whole and streamed, the template's
thinking switch honoured, and what the prefix cache serves a session's next turns when Qwen3's template keeps
the reasoning within a tool loop and drops it once the user speaks again (measured, printed with `-s`).

The model is the scripted checkpoint (tests/scripted_model.py, float32, so its tokens are exact) with a
thinking reply: after the generation prompt it writes `<think>`, one thought, `</think>`, a blank line and
then the scripted tool call; after tool results it answers; after Qwen3's empty block (thinking off) it calls
at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from safetensors.torch import save_file
from tokenizers import AddedToken

import scripted_model
from scripted_model import ANSWER, CALL_PIECES, CITY, GENERATION_PROMPT, WEATHER_CALL
from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.messages_objects import thinking_signature
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from swarmkv.server.pipeline.generate import render_for_model

pytestmark = pytest.mark.e2e  # a live server
TIMEOUT_S = 600.0
BLOCK_SIZE = 16
THOUGHT = "Check the weather."
THOUGHT_TOKEN = f"\n{THOUGHT}\n"
BLANK_LINE = "\n\n"
REASONING_REPLY = f"<think>{THOUGHT_TOKEN}</think>{BLANK_LINE}{WEATHER_CALL}"
THINKING_SCRIPT = {
    **scripted_model.SCRIPT,
    GENERATION_PROMPT: "<think>",
    "<think>": THOUGHT_TOKEN,
    THOUGHT_TOKEN: "</think>",
    "</think>": BLANK_LINE,
    BLANK_LINE: CALL_PIECES[0],  # also after Qwen3's empty block `<think>\n\n</think>\n\n`: a call at once
}
EMPTY_THINK_TOKENS = 4  # `<think>`, `\n\n`, `</think>`, `\n\n`
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = "What is the weather in Paris?"


def make_thinking_checkpoint(folder: Path) -> Path:
    """The scripted checkpoint with the thinking reply."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = scripted_model.scripted_tokenizer()
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (THOUGHT_TOKEN, BLANK_LINE)]
    )
    with mock.patch.object(scripted_model, "SCRIPT", THINKING_SCRIPT):
        weights = scripted_model.scripted_weights(tokenizer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.dumps(
        scripted_model._tokenizer_config(scripted_model.MAX_POSITIONS), indent=2
    )  # the Qwen3 template
    (folder / "tokenizer_config.json").write_text(config, encoding="utf-8")
    hf_config = json.dumps(scripted_model._hf_config(tokenizer, scripted_model.MAX_POSITIONS), indent=2)
    (folder / "config.json").write_text(hf_config, encoding="utf-8")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext

    def post(self, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
        response = httpx.post(self.url + path, json=body, headers=headers, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    def events(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream(
            "POST", self.url + path, json={**body, "stream": True}, timeout=TIMEOUT_S
        ) as response:
            assert response.status_code == 200, response.read()
            lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_thinking_checkpoint(tmp_path_factory.mktemp("thinking") / "thinking")
    return LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory="32MiB",
        max_model_len=4096,
        max_num_seqs=4,
        block_size=BLOCK_SIZE,
    )


@pytest.fixture(scope="module")
def served(llm: LLM) -> Iterator[Served]:
    app = create_app(llm, ServerConfig(served_model_name="scripted"))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": TOOLS,
        **fields,
    }


def test_chat_completions_return_reasoning_content_whole_and_streamed(served: Served) -> None:
    message = served.post("/v1/chat/completions", _chat())["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": CITY}
    deltas = [
        c["choices"][0]["delta"] for c in served.events("/v1/chat/completions", _chat()) if c["choices"]
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all("reasoning_content" not in d for d in deltas[first_call:])


def test_thinking_switched_off_renders_the_empty_block_and_returns_no_reasoning(served: Served) -> None:
    on = served.post("/v1/chat/completions", _chat())
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}):
        off = served.post("/v1/chat/completions", _chat(**fields))
        message = off["choices"][0]["message"]
        assert (
            "reasoning_content" not in message
            and message["tool_calls"][0]["function"]["name"] == "get_weather"
        )
        assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + EMPTY_THINK_TOKENS
    body = {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": _anthropic_tools(),
    }
    message = served.post("/v1/messages", {**body, "thinking": {"type": "disabled"}})
    assert [block["type"] for block in message["content"]] == ["tool_use"]
    reply = served.post(
        "/v1/responses", {"input": QUESTION, "tools": _responses_tools(), "enable_thinking": False}
    )
    assert [item["type"] for item in reply["output"]] == ["function_call"]


def _anthropic_tools() -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _responses_tools() -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in TOOLS]


def test_messages_return_a_signed_thinking_block_whole_and_streamed(served: Served) -> None:
    body = {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": _anthropic_tools(),
        "thinking": {"type": "adaptive"},
    }
    message = served.post("/v1/messages", body)
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][0] == {
        "type": "thinking",
        "thinking": THOUGHT,
        "signature": thinking_signature(THOUGHT),
    }
    assert message["stop_reason"] == "tool_use"
    events = served.events("/v1/messages", body)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert deltas[-1] == {"type": "signature_delta", "signature": thinking_signature(THOUGHT)}


@pytest.mark.parametrize("summary", [None, "auto"])
def test_responses_return_a_reasoning_item_whole_and_streamed(served: Served, summary: str | None) -> None:
    body: dict[str, Any] = {
        "model": "scripted",
        "input": QUESTION,
        "tools": _responses_tools(),
        "store": False,
    }
    if summary is not None:
        body["reasoning"] = {"summary": summary}
    reply = served.post("/v1/responses", body)
    reasoning, call = reply["output"]
    assert reasoning["type"] == "reasoning" and call["type"] == "function_call"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert reasoning["summary"] == ([{"type": "summary_text", "text": THOUGHT}] if summary else [])
    assert reply["reasoning"] == {"effort": None, "summary": summary}
    # `<think>`, the thought and `</think>`, of the reply's 13 tokens.
    assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert reply["usage"]["output_tokens"] == 13
    events = served.events("/v1/responses", body)
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == THOUGHT
    summaries = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    assert summaries == (THOUGHT if summary else "")
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "function_call"]
    assert events[-1]["response"]["output"][0] == reasoning | {
        "id": events[-1]["response"]["output"][0]["id"]
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_sessions_next_turns_are_served_from_cache_when_past_thinking_is_dropped(served: Served) -> None:
    """Turn 2 (the tool loop) renders turn 1's reasoning as the model wrote it; turn 3 (a new question) drops
    it, as Qwen3's template drops past thinking, so the cache serves turn 3 up to turn 1's reply only."""
    tokenizer = served.ctx.tokenizer
    session = {"session_id": "thinking-session"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    previous: list[int] = []  # the previous turn's prompt and reply tokens
    reply: dict[str, Any] = {}
    rows = []
    for turn, follow_up in enumerate((None, "tool", "user"), start=1):
        if follow_up == "tool":
            messages.append(
                {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}
            )
        elif follow_up == "user":
            messages.append({"role": "user", "content": "And tomorrow?"})
        body = {"model": "scripted", "messages": messages, "tools": TOOLS, **session}
        answer = served.post("/v1/chat/completions", body)
        reply = answer["choices"][0]["message"]
        _, rendered = render_for_model(served.ctx, parse_chat_request(body), "chat")
        num_prompt, num_cached = (
            answer["usage"]["prompt_tokens"],
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        )
        assert num_prompt == len(rendered.token_ids)
        shared = _common_prefix(previous, rendered.token_ids)
        rows.append((turn, follow_up or "first", num_prompt, num_cached, shared))
        if previous:
            # Everything shared with the previous turn is served, but for a partial page's tail.
            assert shared - BLOCK_SIZE < num_cached <= shared
        generated = tokenizer.encode(_generated_text(reply), add_special_tokens=False)
        previous = rendered.token_ids + generated
        messages.append(
            {k: v for k, v in reply.items() if k in ("role", "content", "reasoning_content", "tool_calls")}
        )
    (_, _, len1, _, _), (_, _, _, _, shared2), (_, _, _, _, shared3) = rows
    # Turn 2 keeps the reasoning: it shares turn 1's prompt and whole reply. Turn 3 drops it: it shares
    # turn 1's prompt only, up to where turn 1's reply began.
    num_reply_tokens = len(tokenizer.encode(REASONING_REPLY + "<|im_end|>", add_special_tokens=False))
    assert shared2 == len1 + num_reply_tokens
    assert shared3 == len1
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        print("\nturn  after  prompt_tokens  cached_tokens  shared_with_previous_turn")
        for row in rows:
            print("  {}  {:>5}  {:>13}  {:>13}  {:>25}".format(*row))


def _generated_text(reply: dict[str, Any]) -> str:
    """What the model wrote for a chat reply, as the scripted checkpoint writes it."""
    if reply.get("tool_calls"):
        return REASONING_REPLY + "<|im_end|>"
    assert reply["content"] == ANSWER
    return ANSWER + "<|im_end|>"


def test_claude_codes_resent_thinking_block_is_read_from_cache(served: Served) -> None:
    """Claude Code sends the thinking block back with the tool_use: the tool loop's next request renders it
    as the model wrote it, so the cache serves turn 1's reply too, not only its prompt."""
    body: dict[str, Any] = {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Weather in Paris, please?"}],
        "tools": _anthropic_tools(),
        "thinking": {"type": "adaptive"},
        "metadata": {"user_id": "claude-thinking-session"},
    }
    first = served.post("/v1/messages", body)
    usage = first["usage"]
    num_prompt = (
        usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    )
    call_id = first["content"][1]["id"]
    result = {"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": "sunny"}]}
    body["messages"] += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [result]},
    ]
    second = served.post("/v1/messages", body)
    assert second["content"] == [{"type": "text", "text": ANSWER}]
    assert second["usage"]["cache_read_input_tokens"] > num_prompt


def test_codexs_resent_reasoning_item_is_read_from_cache(served: Served) -> None:
    """Codex CLI (store: false) sends the reasoning item back in `input` with the call and its output."""
    body: dict[str, Any] = {
        "model": "scripted",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris weather?"}]}
        ],
        "tools": _responses_tools(),
        "store": False,
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": "codex-thinking-session",
    }
    first = served.post("/v1/responses", body)
    reasoning, call = first["output"]
    # As Codex serializes its ResponseItem::Reasoning: no id, the summary, the reasoning_text content.
    resent = {k: reasoning[k] for k in ("type", "summary", "content", "encrypted_content")}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    call_item = {k: call[k] for k in ("type", "name", "arguments", "call_id")}
    body["input"] += [resent, call_item, output]
    second = served.post("/v1/responses", body)
    assert second["output"][0]["content"][0]["text"] == ANSWER
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > first["usage"]["input_tokens"]
