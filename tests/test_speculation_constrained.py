"""Speculative decoding under a grammar: greedy replies token-identical with drafts and without (jump-forward
on and off, JSON replies and forced calls), drafts cut to what the grammar allows before a forced run with the
matcher left as it was, and sampled replies still valid. The loop guard's side is in tests/test_loop_guard.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from conftest_tokenizer_helpers import qwen_tokenizer
from swarmkv import LLM
from swarmkv.api.structured_request import special_markup
from swarmkv.api.tool_parser import parse_tool_calls
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.structured.decoding import StructuredDecoding
from swarmkv.structured.grammars import json_schema_grammar, tool_call_grammar
from test_structured import SCHEMAS, _check_valid, _prompts, tiny_qwen_loaded


def _llm(speculation: str, jump_forward: str) -> LLM:
    return LLM(
        loaded=tiny_qwen_loaded(),
        kv_cache_memory=32 * 2**20,
        jump_forward=jump_forward,
        speculation=speculation,
    )


def _twice(llm: LLM, params: list[SamplingParams]) -> tuple[list[Any], dict[str, int]]:
    """Each prompt, then each again under the same salt: the second round drafts from the first's replies
    (finished siblings under one head), each under its own grammar. Both rounds' outputs, and the counters."""
    prompts = _prompts()[: len(params)]
    before = llm.engine.stats()
    outputs = [*llm.generate(prompts, params), *llm.generate(prompts, params)]
    llm.engine.check_integrity()
    after = llm.engine.stats()
    keys = ("spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_sibling_tokens", "forced_tokens")
    return outputs, {k: after[k] - before[k] for k in keys}


@pytest.mark.parametrize("jump_forward", ["on", "off"])
def test_greedy_json_replies_are_identical_with_drafts(jump_forward: str) -> None:
    params = [
        SamplingParams(max_tokens=96, temperature=0.0, grammar=json_schema_grammar(SCHEMAS[i % len(SCHEMAS)]))
        for i in range(3)
    ]
    off, _ = _twice(_llm("off", jump_forward), params)
    on, moved = _twice(_llm("on", jump_forward), params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    _check_valid(on[:3])
    _check_valid(on[3:])
    assert moved["spec_accepted_sibling_tokens"] > 0 and moved["forced_tokens"] > 0


@pytest.mark.parametrize("jump_forward", ["on", "off"])
def test_greedy_forced_calls_are_identical_with_drafts(jump_forward: str) -> None:
    tools = [
        {"name": "get_weather", "parameters": SCHEMAS[0]},
        {"name": "get_time", "parameters": SCHEMAS[1]},
    ]
    grammar = tool_call_grammar(tools, "hermes", free_text=False, special=special_markup(qwen_tokenizer()))
    params = [SamplingParams(max_tokens=128, temperature=0.0, grammar=grammar)] * 3
    off, _ = _twice(_llm("off", jump_forward), params)
    on, moved = _twice(_llm("on", jump_forward), params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    offered = [{"type": "function", "function": t} for t in tools]
    for out in on:
        assert (
            out.finish_reason == "stop" and parse_tool_calls(out.text, fmt="hermes", tools=offered).tool_calls
        )
    assert moved["spec_accepted_tokens"] > 0


def test_sampled_replies_with_drafts_stay_valid() -> None:
    params = [
        SamplingParams(max_tokens=96, temperature=0.2, grammar=json_schema_grammar(SCHEMAS[i % 2]))
        for i in range(3)
    ]
    outputs, moved = _twice(_llm("on", "on"), params)
    for i, out in enumerate(outputs):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % 3 % 2])
    assert moved["spec_accepted_tokens"] > 0  # rejection sampling over the masked rows


def test_a_draft_is_cut_before_the_token_that_forces_a_run() -> None:
    tok = qwen_tokenizer()
    structured = StructuredDecoding(tok, tiny_qwen_loaded().config.vocab_size, jump_forward=True)
    state = structured.start(json_schema_grammar(SCHEMAS[0]))
    assert state.queued  # `{"city": "` is forced
    structured.add("r", state)
    assert structured.draftable("r", tuple(tok.encode("Paris", add_special_tokens=False))) == 0  # queued
    structured.advance("r", [0])  # jump-forward takes the queued run (the sampled id is not read)
    matcher = state.matcher
    mask = matcher.compute_bitmask()
    draft = tuple(tok.encode(' "Pari", "unit": "celsius"}', add_special_tokens=False))
    closing = next(i for i, t in enumerate(draft) if i > 0 and '"' in tok.decode([t]))
    # After the string's closing quote the grammar forces `"unit":`: the draft stops before that quote.
    assert closing > 1 and structured.draftable("r", draft) == closing
    assert matcher.compute_bitmask() == mask and not matcher.is_error()  # the matcher is as it was
    letters = tuple(tok.encode(' "Parisian', add_special_tokens=False))  # past maxLength 6: cut where it ends
    assert 1 < structured.draftable("r", letters) < len(letters)
    assert structured.draftable("r", tuple(tok.encode("Paris", add_special_tokens=False))) == 0  # no opening
    assert structured.draftable("unconstrained", draft) == len(draft)


def test_an_output_of_several_tokens_says_where_each_token_ends() -> None:
    """A draft's yield and a forced run arrive as one delta; its `token_text_ends` locate each token's text."""
    llm = _llm("on", "on")
    tok = qwen_tokenizer()
    engine = llm.engine
    grammar = json_schema_grammar(SCHEMAS[0])
    several = 0
    for round_ in range(2):  # the second round drafts from the first's replies
        for i, prompt in enumerate(_prompts()[:2]):
            engine.add_request(
                f"ends-{round_}-{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0, grammar=grammar)
            )
        ids: dict[str, list[int]] = {}
        text: dict[str, str] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                rid = delta.request_id
                ids.setdefault(rid, []).extend(delta.new_token_ids)
                text[rid] = text.get(rid, "") + delta.new_text
                if len(delta.new_token_ids) > 1:
                    several += 1
                    first = len(ids[rid]) - len(delta.new_token_ids)
                    expected = [
                        len(tok.decode(ids[rid][: first + k + 1])) for k in range(len(delta.new_token_ids))
                    ]
                    assert list(delta.token_text_ends) == expected
                    assert delta.token_text_ends[-1] == len(text[rid])
                else:
                    assert delta.token_text_ends == ()
    assert several > 0
