"""Chat templates rendered byte-identically to transformers, the Hermes tool fallback, and template errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest_tokenizer_helpers import (
    SEARCH_TOOL,
    WEATHER_TOOL,
    qwen_hf,
    smol_hf,
    smol_metadata,
)
from swarmkv.errors import InvalidRequestError
from swarmkv.tokenizer import ChatTemplate, Tokenizer

TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SIMPLE = [{"role": "user", "content": "Hello! Wie geht's? 你好 🎉"}]

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Tell me a joke about 42."},
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 25}'},
    {"role": "assistant", "content": "<think>\nBoth warm.\n</think>\n\nParis 21°C, Tokyo 25°C."},
    {"role": "user", "content": "And tomorrow?"},
]

REASONING_TURN = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
]

CONVERSATIONS = {
    "simple": SIMPLE,
    "multi_turn": MULTI_TURN,
    "tools": TOOL_CONVERSATION,
    "reasoning": REASONING_TURN,
}


def _hf_render(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    # Our default is add_generation_prompt=True (the engine always asks for a reply); transformers' is False.
    kwargs.setdefault("add_generation_prompt", True)
    return str(hf.apply_chat_template(messages, tokenize=False, **kwargs))


@pytest.mark.parametrize("conversation", ["simple", "multi_turn", "tools", "reasoning"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_matches_transformers(
    qwen: Tokenizer,
    conversation: str,
    with_tools: bool,
    add_generation_prompt: bool,
    enable_thinking: bool | None,
) -> None:
    messages = CONVERSATIONS[conversation]
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if with_tools:
        kwargs["tools"] = TOOLS
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    assert qwen.apply_chat_template(messages, **kwargs) == _hf_render(qwen_hf(), messages, **kwargs)


def test_qwen3_tool_schemas_keep_non_ascii_and_markup(qwen: Tokenizer) -> None:
    prompt = qwen.apply_chat_template(SIMPLE, tools=TOOLS)
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt
    assert "東京" in prompt and "<b>unescaped</b> &" in prompt


def test_null_content_beside_tool_calls_renders_as_empty_text(qwen: Tokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    with_null = [SIMPLE[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    with_empty = [SIMPLE[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert qwen.apply_chat_template(with_null, tools=TOOLS) == _hf_render(qwen_hf(), with_empty, tools=TOOLS)


@pytest.mark.parametrize("conversation", ["simple", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_gguf_template_matches_transformers(
    smol: Tokenizer, conversation: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _hf_render(smol_hf(), messages, add_generation_prompt=add_generation_prompt)


def _hermes_paragraph(tools: list[dict[str, Any]]) -> str:
    listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{listing}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_tools_without_template_support_join_the_system_message(smol: Tokenizer) -> None:
    ours = smol.apply_chat_template(MULTI_TURN, tools=TOOLS)
    system = {"role": "system", "content": "You are terse.\n\n" + _hermes_paragraph(TOOLS)}
    assert ours == _hf_render(smol_hf(), [system, *MULTI_TURN[1:]], add_generation_prompt=True)


def test_tools_without_template_support_or_system_message_add_one(smol: Tokenizer) -> None:
    ours = smol.apply_chat_template(SIMPLE, tools=[SEARCH_TOOL], add_generation_prompt=False)
    system = {"role": "system", "content": _hermes_paragraph([SEARCH_TOOL])}
    assert ours == _hf_render(smol_hf(), [system, *SIMPLE], add_generation_prompt=False)
    assert ours.startswith("<|im_start|>system\n# Tools\n")


def test_tool_calls_fold_into_content_when_template_cannot_render_them(smol: Tokenizer) -> None:
    ours = smol.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert (
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call><|im_end|>\n'
    ) in ours
    # Tool results render the way the template renders any role.
    assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>\n' in ours


def test_template_environment_matches_transformers() -> None:
    source = (
        "{% set ns = namespace(count=0) %}"
        "{% for message in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.count = ns.count + 1 %}"
        "{% generation %}{{ message['content'] | tojson }}|{{ message | tojson(indent=2) }}{% endgeneration %}\n"
        "  {% if message.role == 'user' %}\n    U{{ ns.count }}\n  {% endif %}\n"
        "{% endfor %}{{ dict(a=1) | tojson }}{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
    )
    messages = [
        {"role": "user", "content": 'é <tag> & "q"', "z": 1, "a": 2},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "never rendered"},
    ]
    template = ChatTemplate(source=source, special_tokens=(("bos_token", "<s>"), ("eos_token", "</s>")))
    expected = _hf_render(smol_hf(), messages, chat_template=source, bos_token="<s>", eos_token="</s>")
    assert template.render(messages) == expected


def test_missing_template_raises_invalid_request() -> None:
    meta = {key: value for key, value in smol_metadata().items() if key != "tokenizer.chat_template"}
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template(SIMPLE)


@pytest.mark.parametrize(
    ("source", "messages", "match"),
    [
        ("{{ raise_exception('roles must alternate') }}", SIMPLE, "roles must alternate"),
        ("{% for m in messages %}{{ m.content", SIMPLE, "does not compile"),
        ("{{ messages[0].content + messages[0].missing }}", SIMPLE, "rejected"),
        ("{{ messages }}", [], "non-empty"),
        ("{{ messages }}", ["not a dict"], "object"),
    ],
)
def test_template_errors_are_invalid_requests(source: str, messages: list[Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        ChatTemplate(source=source).render(messages)


def test_named_tool_use_template_is_picked_for_tools(tmp_path: Any) -> None:
    from conftest_tokenizer_helpers import qwen_dir

    (tmp_path / "tokenizer.json").write_bytes((qwen_dir() / "tokenizer.json").read_bytes())
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.apply_chat_template(SIMPLE) == "plain"
    assert tokenizer.apply_chat_template(SIMPLE, tools=TOOLS) == "2"
