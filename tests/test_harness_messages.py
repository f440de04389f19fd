"""Claude Code's first request, as it sends it by default, on the Messages API: a system message inside
`messages`, `thinking`, `context_management`, `output_config`, a JSON `metadata.user_id`, betas in a header
and the query; and the served model's aliases and "*", so its two model names need no configuration.

The fixture (claude_code_first_request.json) is Claude Code 2.1.332's first request with its structure kept
and its texts and tools trimmed to fit the scripted checkpoint's 8K positions (one token a byte).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmkv.api.errors import APIError
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.render import render_chat, system_turns_in_place
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.cli import model_names_line
from swarmkv.server.context import ServerContext
from swarmkv.tokenizer import Tokenizer
from swarmkv.tokenizer.chat import ChatTemplate

API_KEY = "test-key"
TIMEOUT_S = 600.0
FIXTURE = json.loads((Path(__file__).parent / "claude_code_first_request.json").read_text(encoding="utf-8"))
SESSION = "bc2985ab-dfd3-4e5b-8a67-c2a349cc3cfe"  # the session_id in the fixture's metadata.user_id
# Claude Code asks for max_tokens 32000 on any model: the server clamps it to what the 8K context leaves.
SMALL_MODEL = "claude-haiku-4-5"  # Claude Code's small/fast model, served as an alias
# A template that raises on a system turn after the first message, as Gemma's and Mistral's do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system messages must come first') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Claude Code's fallback drops the mid-conversation system message only on errors matching these (from its binary).
CLAUDE_CODE_FALLBACK_TEXTS = ("Input should be 'user' or 'assistant'", "use the top-level 'system' parameter")


def _body(**changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(FIXTURE["body"])
    assert body["max_tokens"] == 32000, "the request as Claude Code sends it"
    body.update(changes)
    return body


def _headers() -> dict[str, str]:
    return {**FIXTURE["headers"], "x-api-key": API_KEY}


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    log_path: Path

    def post(self, body: dict[str, Any], path: str = FIXTURE["path"]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=_headers(), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def llm(scripted_model_dir: Path) -> LLM:
    return LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=8192, max_num_seqs=4
    )


@pytest.fixture(scope="module")
def served(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_path = tmp_path_factory.mktemp("log") / "requests.jsonl"
    config = ServerConfig(api_key=API_KEY, served_model_name=f"scripted,{SMALL_MODEL}", log_requests=log_path)
    app = create_app(llm, config)
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx, log_path)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


@pytest.mark.e2e
def test_first_request_streamed_as_sent_gets_a_reply(served: Served) -> None:
    with httpx.stream(
        "POST", served.url + FIXTURE["path"], json=_body(), headers=_headers(), timeout=TIMEOUT_S
    ) as response:
        assert response.status_code == 200, response.read()
        events = [
            json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    # The scripted reply is one call; under the tools' grammar it names one of Claude Code's own tools.
    assert [block["type"] for block in starts] == ["tool_use"]
    assert starts[0]["name"] in {t["name"] for t in FIXTURE["body"]["tools"]}
    arguments = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert isinstance(json.loads(arguments), dict)
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"


@pytest.mark.e2e
def test_first_request_whole_names_its_session(served: Served) -> None:
    response = served.post(_body(stream=False, model=SMALL_MODEL))  # the small model, by its alias
    assert response.status_code == 200, response.text
    message = response.json()
    assert [block["type"] for block in message["content"]] == ["tool_use"]
    assert message["content"][0]["name"] in {t["name"] for t in FIXTURE["body"]["tools"]}
    logged = [json.loads(line) for line in served.log_path.read_text().splitlines()]
    logged = [record for record in logged if "body" in record]  # not the requests' end lines
    assert logged and {record["session_id"] for record in logged} == {SESSION}
    assert logged[-1]["body"]["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.e2e
def test_claude_code_session_header_names_a_session_without_user_id(served: Served) -> None:
    before = len(served.log_path.read_text().splitlines()) if served.log_path.exists() else 0
    body = _body(stream=False, metadata={})
    headers = {**_headers(), "X-Claude-Code-Session-Id": "cc-session-2"}
    response = httpx.post(served.url + "/v1/messages", json=body, headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    headers["X-Session-Id"] = "mine"  # swarmkv's own header wins over the client's
    response = httpx.post(served.url + "/v1/messages", json=body, headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    logged = [json.loads(line) for line in served.log_path.read_text().splitlines()[before:]]
    assert [record["session_id"] for record in logged if "body" in record] == ["cc-session-2", "mine"]


@pytest.mark.e2e
def test_aliases_are_listed_and_unknown_names_are_404(served: Served) -> None:
    listed = httpx.get(served.url + "/v1/models", headers=_headers(), timeout=TIMEOUT_S).json()
    assert [card["id"] for card in listed["data"]] == ["scripted", SMALL_MODEL]
    response = served.post(_body(model="claude-opus-4-8"))
    assert response.status_code == 404
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error"


@pytest.mark.e2e
def test_structured_output_is_honoured(served: Served) -> None:
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    body = _body(output_config={"effort": "high", "format": schema}, stream=False, max_tokens=256)
    response = served.post(body)
    assert response.status_code == 200, response.text
    # With tools offered the reply is the format's JSON or calls (the scripted model calls).
    for block in response.json()["content"]:
        assert block["type"] == "tool_use" or isinstance(json.loads(block["text"]), dict)
    bad = {"type": "json_schema", "schema": {"type": "string", "format": "no-such-format"}, "strict": True}
    refused = served.post(_body(output_config={"format": bad}, tools=None, stream=False))
    assert refused.status_code == 400 and "format" in refused.json()["error"]["message"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("index", "message", "expected"),
    [
        (1, {"role": "tool", "content": "x"}, "messages.1.role: Input should be 'user' or 'assistant'"),
        (0, {"role": "system", "content": "x"}, "messages.0: use the top-level 'system' parameter"),
    ],
)
def test_bad_roles_are_refused_in_anthropic_words(
    served: Served, index: int, message: dict[str, Any], expected: str
) -> None:
    body = _body()
    body["messages"][index] = message
    response = served.post(body)
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    text = response.json()["error"]["message"]
    assert text.startswith(expected) and any(pattern in text for pattern in CLAUDE_CODE_FALLBACK_TEXTS)


def test_any_name_is_served_under_star_but_not_listed(llm: LLM) -> None:
    ctx: ServerContext = create_app(llm, ServerConfig(served_model_name="*")).state.ctx
    ctx.check_model("claude-sonnet-4-6")
    assert ctx.model_name == llm.loaded.path.name  # the default name still names replies
    assert ctx.listed_model_names == (llm.loaded.path.name,)
    ctx = dataclasses.replace(ctx, model_names=("main", "*"), model_name="main")
    ctx.check_model("anything")
    assert ctx.listed_model_names == ("main",)
    strict: ServerContext = create_app(llm, ServerConfig(served_model_name=llm.loaded.path.name)).state.ctx
    strict.check_model(llm.loaded.path.name)
    with pytest.raises(APIError) as refused:
        strict.check_model("claude-sonnet-4-6")
    assert refused.value.status == 404


def test_by_default_any_name_is_answered_and_named_in_the_reply(llm: LLM) -> None:
    """Claude Code asks for a second, small model: a one-model server answers it, as llama-server does."""
    ctx: ServerContext = create_app(llm, ServerConfig()).state.ctx
    assert ctx.answers_any_name
    ctx.check_model("claude-haiku-4-5")
    assert ctx.reply_model("claude-haiku-4-5") == "claude-haiku-4-5"
    assert ctx.reply_model(None) == ctx.model_name == llm.loaded.path.name
    assert ctx.listed_model_names == (llm.loaded.path.name,)
    restricted: ServerContext = create_app(llm, ServerConfig(served_model_name="main,alias")).state.ctx
    assert not restricted.answers_any_name and restricted.reply_model("alias") == "main"
    assert "any model name" in model_names_line(ctx) and "'main', 'alias'" in model_names_line(restricted)


def test_served_model_name_takes_several_names() -> None:
    assert ServerConfig(served_model_name="a, b,*").model_names == ("a", "b", "*")
    assert ServerConfig().model_names == ()
    with pytest.raises(ValueError, match="empty name"):
        ServerConfig(served_model_name="a,,b")


def test_parsed_request_keeps_the_system_message_in_place_and_ignores_what_only_tunes_the_service() -> None:
    req = parse_messages_request(_body())
    assert [m["role"] for m in req.chat.messages] == ["system", "user", "system"]
    assert req.chat.messages[2]["content"].startswith("# Environment")
    assert req.user_id == SESSION  # not the raw 150-character JSON
    assert req.template_kwargs == {"enable_thinking": True}  # thinking: adaptive
    assert len(req.breakpoints) == 3  # two system blocks and the system message's block
    # A deferred tool (`defer_loading`) stays out of the prompt's tool block until a tool search loads it.
    assert [tool["function"]["name"] for tool in req.chat.tools or []] == ["Bash", "Read"]
    assert req.chat.loaded_tools is None


def test_system_message_renders_where_it_stands_on_qwen3(llm: LLM) -> None:
    req = parse_messages_request(_body())
    text = render_chat(llm.tokenizer, req.chat, template_kwargs=req.template_kwargs).text
    task = text.index("list the files<|im_end|>\n")
    system_turn = text.index("<|im_start|>system\n# Environment")
    assert task < system_turn < text.index("<|im_start|>assistant\n", system_turn)
    assert "<system-reminder>\n# Environment" not in text


def test_thinking_maps_to_the_templates_switch(llm: LLM) -> None:
    def rendered(thinking: Any) -> str:
        req = parse_messages_request(_body(thinking=thinking))
        return render_chat(llm.tokenizer, req.chat, template_kwargs=req.template_kwargs).text

    empty_thinking = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert rendered({"type": "disabled"}).endswith(empty_thinking)
    assert not rendered({"type": "enabled", "budget_tokens": 1024}).endswith(empty_thinking)
    with pytest.raises(APIError, match="thinking.type"):
        parse_messages_request(_body(thinking={"type": "sometimes"}))


def _strict_tokenizer(llm: LLM) -> Tokenizer:
    """The scripted checkpoint's tokenizer under a template that cannot render a system turn in place."""
    return dataclasses.replace(llm.tokenizer, template=ChatTemplate(STRICT_TEMPLATE))


def test_system_message_joins_the_user_turn_as_a_reminder_where_the_template_cannot_render_it(
    llm: LLM,
) -> None:
    tokenizer = _strict_tokenizer(llm)
    assert not ChatTemplate(STRICT_TEMPLATE).renders_system_in_place
    req = parse_messages_request(_body())
    messages = system_turns_in_place(tokenizer, req.chat.messages)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "list the files\n\n<system-reminder>\n# Environment" in messages[1]["content"]
    assert messages[1]["content"].endswith("\n</system-reminder>")
    text = render_chat(tokenizer, req.chat).text
    assert (
        text.index("list the files") < text.index("<system-reminder>\n# Environment") < text.index("</user>")
    )


def test_a_reminder_with_no_user_turn_before_it_opens_the_next(llm: LLM) -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "note"},
        {"role": "user", "content": "go on"},
    ]
    messages = system_turns_in_place(_strict_tokenizer(llm), history)
    assert messages[2] == {"role": "user", "content": "<system-reminder>\nnote\n</system-reminder>\n\ngo on"}
    assert len(messages) == 3


def test_a_tool_search_result_of_tool_references_is_read_as_the_tools_it_found() -> None:
    """Claude Code's ToolSearch answers with `tool_reference` blocks (Anthropic's API expands each into a deferred
    tool's definition); every tool is already in swarmkv's prompt, so each becomes a line naming the tool."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "select:Read"}}
    found = [{"type": "tool_reference", "tool_name": "Read"}, {"type": "text", "text": "1 match"}]
    messages = [
        {"role": "user", "content": "read the README"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": found}]},
    ]
    req = parse_messages_request(_body(messages=messages))
    tool = next(m for m in req.chat.messages if m["role"] == "tool")
    assert tool["content"] == "Tool loaded: Read\n1 match"  # offered in full already: nothing to expand
    assert req.chat.loaded_tools is None

    # A deferred tool it loads: its definition in the result, callable, and the tool block unchanged.
    deferred = next(t for t in _body()["tools"] if t.get("defer_loading"))
    loading = copy.deepcopy(messages)
    loading[2]["content"][0]["content"] = [{"type": "tool_reference", "tool_name": deferred["name"]}]
    loaded = parse_messages_request(_body(messages=loading))
    result = next(m for m in loaded.chat.messages if m["role"] == "tool")["content"]
    assert result.startswith(f"Tool loaded: {deferred['name']}\n{{")
    assert json.loads(result.split("\n", 1)[1])["parameters"] == deferred["input_schema"]
    assert loaded.chat.tools == req.chat.tools
    assert [t["function"]["name"] for t in loaded.chat.callable_tools or []] == [
        "Bash",
        "Read",
        deferred["name"],
    ]
    nameless = [{**messages[2]["content"][0], "content": [{"type": "tool_reference"}]}]
    with pytest.raises(APIError, match=r"content\[0\]\.tool_name"):
        parse_messages_request(_body(messages=[*messages[:2], {"role": "user", "content": nameless}]))
