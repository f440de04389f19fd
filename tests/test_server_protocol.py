"""Request validation without a model: typed requests out, OpenAI error objects for everything else."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.completion_request import parse_completion_request
from swarmkv.api.errors import APIError, parse_json_body
from swarmkv.options import engine_kwargs
from swarmkv.server.cli import register

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OTHER_TOOL = {"type": "function", "function": {"name": "search"}}
USER = [{"role": "user", "content": "hi"}]


def _error(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def test_error_object_has_the_openai_shape() -> None:
    error = _error(parse_chat_request, {"messages": USER, "temperature": "hot"})
    assert error.status == 400
    assert error.to_json() == {
        "error": {
            "message": "'temperature' must be a number, got string",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "temperature": 3}, "temperature"),
        ({"messages": USER, "stop": ["", "x"]}, "stop"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "n": 2}, "n"),
        ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": USER, "logprobs": True}, "logprobs"),
        ({"messages": USER, "cache_salt": ""}, "cache_salt"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": USER,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"messages": USER, "model": 7}, "model"),
    ],
)
def test_bad_chat_fields_name_their_param(body: dict[str, Any], param: str) -> None:
    error = _error(parse_chat_request, body)
    assert (error.status, error.param) == (400, param)


def test_bad_json_and_non_objects_are_400() -> None:
    assert _error(parse_json_body, b"{nope").status == 400
    assert _error(parse_json_body, b"[1, 2]").status == 400
    assert _error(parse_json_body, b"\xff\xfe").status == 400
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_messages_are_normalised_for_the_chat_template() -> None:
    req = parse_chat_request(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "hi", "unknown": 1},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        }
    )
    assert req.messages == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert req.tool_choice.mode == "none" and not req.parses_tool_calls


def test_defaults_and_sampling_params() -> None:
    req = parse_chat_request(
        {"messages": USER, "stop": "END", "seed": 3, "max_completion_tokens": 5, "max_tokens": 9}
    )
    params = req.options.sampling_params(10, 100, "messages")
    assert (params.max_tokens, params.stop, params.seed, params.temperature) == (5, ("END",), 3, 1.0)
    unlimited = parse_chat_request({"messages": USER}).options.sampling_params(10, 100, "messages")
    assert unlimited.max_tokens == 90  # what the context leaves after the prompt


def test_context_overflow_is_a_400_with_code() -> None:
    options = parse_chat_request({"messages": USER, "max_tokens": 50}).options
    too_long = _error(options.sampling_params, 100, 100, "messages")
    assert (too_long.param, too_long.code) == ("messages", "context_length_exceeded")
    # Past what the context leaves: clamped to it by default, a 400 under the "refuse" policy.
    assert options.sampling_params(60, 100, "messages").max_tokens == 40
    too_many = _error(options.sampling_params, 60, 100, "messages", (), "refuse")
    assert (too_many.param, too_many.code) == ("max_tokens", "context_length_exceeded")
    assert options.sampling_params(50, 100, "messages", (), "refuse").max_tokens == 50


def test_tool_choice_forces_a_call_prefix_and_a_stop() -> None:
    auto = parse_chat_request({"messages": USER, "tools": [TOOL, OTHER_TOOL]})
    assert auto.tool_choice.mode == "auto" and auto.parses_tool_calls
    assert auto.forced_prefix() == "" and auto.forced_stop() == ()
    named = parse_chat_request(
        {
            "messages": USER,
            "tools": [TOOL, OTHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "search"}},
        }
    )
    assert named.forced_prefix() == '<tool_call>\n{"name": "search", "arguments": '
    assert named.forced_stop() == ("</tool_call>",)
    only_one = parse_chat_request({"messages": USER, "tools": [TOOL], "tool_choice": "required"})
    assert only_one.forced_prefix() == '<tool_call>\n{"name": "get_weather", "arguments": '
    several = parse_chat_request({"messages": USER, "tools": [TOOL, OTHER_TOOL], "tool_choice": "required"})
    assert several.forced_prefix() == '<tool_call>\n{"name": "'
    off = parse_chat_request({"messages": USER, "tools": [TOOL], "tool_choice": "none"})
    assert not off.parses_tool_calls and off.forced_prefix() == ""


@pytest.mark.parametrize(
    ("parameters", "opening"),
    [
        ({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, '{"city": "'),
        ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n", "m"]}, '{"n": '),
        ({"type": "object", "properties": {"n": {"type": "integer"}}}, ""),  # nothing required
        ({"type": "object", "required": ["x"]}, ""),  # a required key without a schema
        ({"type": "object", "properties": {"é": {"type": "string"}}, "required": ["é"]}, '{"é": "'),
    ],
)
def test_a_named_call_opens_with_its_first_required_key(parameters: dict[str, Any], opening: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    req = parse_chat_request({"messages": USER, "tools": [tool], "tool_choice": "required"})
    assert req.forced_prefix() == '<tool_call>\n{"name": "f", "arguments": ' + opening


def test_completion_prompts() -> None:
    assert parse_completion_request({"prompt": "hello"}).prompt == "hello"
    assert parse_completion_request({"prompt": ["hello"]}).prompt == "hello"
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion_request({"prompt": [[4, 5]]}).prompt == [4, 5]
    for bad in (
        {"prompt": ["a", "b"]},
        {"prompt": []},
        {"prompt": [1, "x"]},
        {},
        {"prompt": "a", "echo": True},
    ):
        assert _error(parse_completion_request, bad).status == 400


def test_serve_command_defaults_to_loopback() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.prefix_caching) == ("127.0.0.1", 8000, True)
    args = parser.parse_args(
        ["serve", "--port", "0", "--api-key", "k", "--no-prefix-caching", "--kv-cache-memory", "64MiB"]
    )
    assert (args.port, args.api_key, args.prefix_caching, args.kv_cache_memory) == (0, "k", False, 64 * 2**20)
    assert engine_kwargs(args)["cascade_attention"] == "auto"  # the EngineConfig default, not a copy of it


@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
def test_media_parts_are_refused_by_name(kind: str) -> None:
    part = {"type": kind, kind: {"url": "data:image/png;base64,AAAA"}}
    error = _error(parse_chat_request, {"messages": [{"role": "user", "content": [part]}]}).to_json()["error"]
    assert error["param"] == "messages[0].content"
    assert f"{kind} parts are not supported" in error["message"]
    assert "text model only" in error["message"]
