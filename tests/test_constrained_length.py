"""Constrained replies that reach max_tokens still parse (issue 53): once the tokens left come down to the
shortest ending the grammar allows, the engine forces it; finish_reason stays "length". On the float32 tiny
model over the Qwen3 vocabulary, whose sampled strings run on until cut: with `close_at_length` every reply
parses, one forced token a step or jump-forward, and without it some do not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from conftest_tokenizer_helpers import qwen_tokenizer
from swarmkv import LLM
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.structured.decoding import StructuredDecoding
from swarmkv.structured.grammars import json_schema_grammar
from test_structured import _prompts, tiny_qwen_loaded

_STRINGS = {"type": "array", "items": {"type": "string"}}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "tags": _STRINGS, "n": {"type": "integer"}},
    "required": ["title", "tags", "n"],
}
NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "files": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "why": {"type": "string"}},
                "required": ["path", "why"],
            },
        }
    },
    "required": ["files"],
}


def _generate(llm: LLM, schema: dict[str, Any], max_tokens: int, seeds: range) -> list[Any]:
    grammar = json_schema_grammar(schema)
    prompts = _prompts()[: len(seeds)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, grammar=grammar) for s in seeds]
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return outputs


@pytest.mark.parametrize(
    ("jump_forward", "schema", "max_tokens"),
    [("on", SCHEMA, 24), ("off", NESTED, 31), pytest.param("on", NESTED, 40, marks=pytest.mark.slow)],
)
def test_replies_cut_by_their_length_parse(
    jump_forward: str, schema: dict[str, Any], max_tokens: int
) -> None:
    llm = LLM(loaded=tiny_qwen_loaded(), kv_cache_memory=32 * 2**20, jump_forward=jump_forward)
    outputs = _generate(llm, schema, max_tokens, range(3))
    for out in outputs:
        assert out.error is None and out.finish_reason in ("length", "stop")
        assert len(out.token_ids) <= max_tokens
        jsonschema.validate(json.loads(out.text), schema)
    assert any(out.finish_reason == "length" for out in outputs)  # the length did cut them


def test_without_closing_some_cut_replies_do_not_parse() -> None:
    llm = LLM(loaded=tiny_qwen_loaded(), kv_cache_memory=32 * 2**20, close_at_length=False)
    outputs = _generate(llm, SCHEMA, 20, range(4))
    unparsed = 0
    for out in outputs:
        try:
            json.loads(out.text)
        except ValueError:
            unparsed += 1
    assert unparsed > 0


def test_a_max_tokens_equal_to_the_shortest_ending_at_the_start_parses() -> None:
    structured = StructuredDecoding(qwen_tokenizer(), tiny_qwen_loaded().config.vocab_size, jump_forward=True)
    state = structured.start(json_schema_grammar(SCHEMA))
    assert state.ending is not None
    shortest = len(state.queued) + len(state.ending)  # the forced opening, then the ending from there
    llm = LLM(loaded=tiny_qwen_loaded(), kv_cache_memory=32 * 2**20, jump_forward="on")
    for out in _generate(llm, SCHEMA, shortest, range(3)):
        assert out.finish_reason == "length" and len(out.token_ids) == shortest
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_an_ending_takes_the_matcher_to_where_the_grammar_may_end() -> None:
    tok = qwen_tokenizer()
    structured = StructuredDecoding(tok, tiny_qwen_loaded().config.vocab_size, jump_forward=True)
    closer = structured.closer
    assert closer is not None
    for text in ('{"title": "a', '{"title": "", "tags": [', '{"title": "", "tags": ["x", "y', '{"title": ""'):
        matcher = structured.grammars.matcher(json_schema_grammar(SCHEMA))
        ids = tok.encode(text, add_special_tokens=False)
        assert matcher.validate_tokens(ids) == len(ids)
        matcher.consume_tokens(ids)
        ending = closer.ending(matcher)
        assert ending is not None and not matcher.is_accepting()  # the matcher is left where it was
        jsonschema.validate(json.loads(text + tok.decode(ending)), SCHEMA)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_a_token_that_takes_the_ending_past_the_tokens_left_gives_way_to_the_ending_before_it(
    jump_forward: bool,
) -> None:
    tok = qwen_tokenizer()
    structured = StructuredDecoding(tok, tiny_qwen_loaded().config.vocab_size, jump_forward=jump_forward)
    state = structured.start(json_schema_grammar(SCHEMA))
    structured.add("r", state)
    reply: list[int] = []
    target = '{"title": "x", "tags": ['
    while tok.decode(reply) != target or state.queued:  # the text, through the grammar's forced runs
        rest = target[len(tok.decode(reply)) :]
        token = tok.encode(rest, add_special_tokens=False)[0] if not state.queued else 0
        reply += structured.fit("r", 1000, structured.advance("r", [token]))
    before = structured.closer.ending(state.matcher) if structured.closer else None
    assert before is not None and tok.decode(before) == '], "n": 0}'
    state.ending, state.near = before, True  # as a step near the length leaves them
    # An opening quote leaves len(before) - 1 tokens, and the ending after it is longer: the quote goes.
    quote = tok.encode('"', add_special_tokens=False)
    reply += structured.fit("r", len(before), structured.advance("r", quote))
    assert structured.closed("r")
    while state.queued:
        reply += structured.advance("r", [0])
    assert json.loads(tok.decode(reply)) == {"title": "x", "tags": [], "n": 0}
    assert len(reply) - reply.index(before[0]) == len(before)
