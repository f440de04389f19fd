"""Constrained decoding: every constrained reply parses and validates against its schema, on a float32 tiny
model with the Qwen3 vocabulary (exact tokens: jump-forward against one forced token a step, prefix caching
on and off, preemption) and on the embedded default (parse and validation only); unsupported schema
features are refused naming the feature; a shared grammar compiles once."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from conftest_tokenizer_helpers import qwen_tokenizer
from engine_helpers import tiny_config
from swarmkv import LLM
from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.errors import APIError
from swarmkv.api.render import render_request
from swarmkv.api.structured_request import reply_constraint, special_markup
from swarmkv.api.tool_parser import parse_tool_calls
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.loader import LoadedModel
from swarmkv.structured.grammars import UnsupportedSchemaError, json_schema_grammar, tool_call_grammar
from tiny_models import qwen_vocab_size

# Bounded strings and numbers, so a random model's reply ends inside a modest budget.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        },
        "required": ["ok", "n", "tags"],
        "additionalProperties": False,
    },
    {
        "$defs": {"point": {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"]}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}, "kind": {"anyOf": [{"const": "a"}, {"type": "null"}]}},
        "required": ["p", "kind"],
        "additionalProperties": False,
    },
]


@cache
def tiny_qwen_loaded() -> LoadedModel:
    """A 2-layer float32 Llama over the whole Qwen3 vocabulary (its end-of-turn ids are real logits)."""
    config = tiny_config(vocab_size=qwen_vocab_size())
    torch.manual_seed(0)
    model = DecoderForCausalLM(config).to(torch.float32)
    model.rotary.build(torch.device("cpu"))
    tok = qwen_tokenizer()
    return LoadedModel(Path("tiny"), "tiny", config, model.eval(), tok, torch.float32, torch.device("cpu"))


def _llm(**kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", 32 * 2**20)
    kwargs.setdefault("jump_forward", "on")
    return LLM(loaded=tiny_qwen_loaded(), **kwargs)


def _prompts() -> list[list[int]]:
    tok = qwen_tokenizer()
    head = tok.encode("A shared system prompt long enough to fill a page or two of the KV pool. " * 3)
    return [head + tok.encode(f" Request {i}: answer in JSON.") for i in range(6)]


def _params(i: int, max_tokens: int = 96) -> SamplingParams:
    grammar = json_schema_grammar(SCHEMAS[i % len(SCHEMAS)])
    temperature, seed = (0.0, None) if i % 2 == 0 else (0.9, 100 + i)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, grammar=grammar)


def _check_valid(outputs: list[Any]) -> None:
    for i, out in enumerate(outputs):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])


def _generate(llm: LLM) -> list[Any]:
    prompts = _prompts()
    return llm.generate(prompts, [_params(i) for i in range(len(prompts))])


def test_constrained_replies_validate_and_jump_forward_gives_the_same_tokens() -> None:
    fast = _llm()
    jumped = _generate(fast)
    _check_valid(jumped)
    assert fast.engine.structured.num_forced_tokens > 0
    slow = _generate(_llm(jump_forward="off"))
    _check_valid(slow)
    # Greedy rows: the same tokens (a sampled row's draws differ: each step of the slow way draws one).
    assert [o.token_ids for o in slow[::2]] == [o.token_ids for o in jumped[::2]]
    fast.engine.check_integrity()


def test_prefix_caching_off_and_preemption_leave_the_tokens_alone() -> None:
    reference = [o.token_ids for o in _generate(_llm())]
    assert [o.token_ids for o in _generate(_llm(prefix_caching=False))] == reference
    # A pool of a few pages: requests are preempted and recomputed mid-reply, matchers untouched.
    small = _llm(kv_cache_memory=9 * 16 * tiny_qwen_loaded().config.kv_bytes_per_token(torch.float32))
    outputs = _generate(small)
    assert small.engine.counters.preemptions > 0
    assert [o.token_ids for o in outputs] == reference
    _check_valid(outputs)


def test_a_grammar_shared_by_many_requests_compiles_once() -> None:
    llm = _llm()
    tools = [{"name": f"tool_{i}", "parameters": SCHEMAS[i % len(SCHEMAS)]} for i in range(12)]
    grammar = tool_call_grammar(tools, "hermes", free_text=True, special=special_markup(qwen_tokenizer()))
    params = SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar)
    llm.generate(_prompts() + _prompts()[:2], params)
    assert llm.engine.structured.grammars.num_compiled == 1
    assert llm.engine.structured.grammars.num_hits == 7


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
        ({"type": "string", "format": "hostname-ish"}, "format"),
    ],
)
def test_unsupported_features_are_refused_by_name(schema: dict[str, Any], feature: str) -> None:
    with pytest.raises(UnsupportedSchemaError, match=feature):
        json_schema_grammar(schema)
    json_schema_grammar(schema, strict=False)  # not strict: the keyword is left unenforced


def _chat(body: dict[str, Any]) -> tuple[Any, SamplingParams]:
    tok = qwen_tokenizer()
    req, rendered = render_request(
        tok, parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], **body})
    )
    constraint = reply_constraint(req, special_markup(tok))
    return req, req.options.sampling_params(len(rendered.token_ids), 4096, "messages", constraint=constraint)


def test_chat_bodies_become_grammars_and_strict_tools_refuse_unsupported_keywords() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMAS[0], "strict": True}}
    assert _chat({"response_format": fmt})[1].grammar is not None
    assert _chat({"response_format": {"type": "json_object"}})[1].grammar is not None
    assert _chat({})[1].grammar is None
    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    strict_tool = {"type": "function", "function": {"name": "f", "parameters": bad, "strict": True}}
    with pytest.raises(APIError, match="dependentSchemas") as refused:
        _chat({"tools": [strict_tool]})
    assert refused.value.status == 400 and refused.value.param == "tools"
    loose_tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    assert _chat({"tools": [loose_tool]})[1].grammar is not None


@pytest.mark.parametrize("jump_forward", ["on", "off"])
def test_a_forced_call_parses_into_a_call_that_follows_the_schema(jump_forward: str) -> None:
    llm = _llm(jump_forward=jump_forward)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[0]}}
    other = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS[1]}}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        req, params = _chat({"tools": [tool, other], "tool_choice": choice, "max_tokens": 128})
        tok = qwen_tokenizer()
        _, rendered = render_request(tok, req)
        (out,) = llm.generate([rendered.token_ids], params)
        parsed = parse_tool_calls(req.forced_call_opening() + out.text, fmt="hermes", tools=req.prompt_tools)
        assert out.finish_reason == "stop" and parsed.tool_calls and not parsed.content.strip()
        for call in parsed.tool_calls:  # one call or more, each of an offered tool under its schema
            schema = SCHEMAS[0] if call.name == "get_weather" else SCHEMAS[1]
            jsonschema.validate(json.loads(call.arguments), schema)
            if isinstance(choice, dict):
                assert call.name == "get_time"


def test_xml_calls_parse_and_follow_the_schema() -> None:
    """Qwen3.5's XML form as the whole reply (tool_choice required), on the Qwen3 vocabulary (whose
    `<tool_call>` is one special token); typed values come back as JSON of their schema's type."""
    llm = _llm()
    tools = [
        {"name": "get_weather", "parameters": SCHEMAS[0]},
        {"name": "get_time", "parameters": SCHEMAS[1]},
    ]
    grammar = tool_call_grammar(tools, "xml", free_text=False, special=special_markup(qwen_tokenizer()))
    params = SamplingParams(max_tokens=160, temperature=0.0, grammar=grammar)
    offered = [{"type": "function", "function": t} for t in tools]
    for out in llm.generate(_prompts()[:3], params):
        assert out.finish_reason == "stop", out.text
        parsed = parse_tool_calls(out.text, fmt="xml", tools=offered)
        assert parsed.tool_calls
        for call in parsed.tool_calls:
            schema = SCHEMAS[0] if call.name == "get_weather" else SCHEMAS[1]
            jsonschema.validate(json.loads(call.arguments), schema)


def test_tool_call_grammar_strict_leaves_auto_calls_free() -> None:
    """`--tool-call-grammar strict`: an auto call of tools none of which is strict follows no grammar; a strict
    tool, a forced call or a reply format still does."""
    from swarmkv.api.chat_request import parse_chat_request
    from swarmkv.api.structured_request import reply_constraint

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    strict_tool = {"type": "function", "function": {**tool["function"], "strict": True}}

    def constrained(strict_only: bool, **body: Any) -> bool:
        req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body})
        return reply_constraint(req, strict_only=strict_only) is not None

    assert constrained(False, tools=[tool])
    assert not constrained(True, tools=[tool])
    assert constrained(True, tools=[strict_tool])
    assert constrained(True, tools=[tool], tool_choice="required")
    assert constrained(True, tools=[tool], response_format={"type": "json_object"})
