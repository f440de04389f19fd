"""The loop guard: a reply repeating itself verbatim is steered out of the loop, a copy is left alone.

The engine tests run a float32 bigram over the Qwen3 vocabulary built here: "A" predicts "B" and "B"
predicts "A", each by a logit of MARGIN, with the closing quote half as likely. Under a grammar for
`{"s": <string>}` its greedy reply loops "ABAB..." until max_tokens without the guard; with it, the loop's
continuation is penalised once the loop spans MIN_SPAN tokens, the quote wins, and the reply parses.
A second bigram resumes a broken loop ("ABAB...ACABAB..."), as the embedded model resumes its own in
variants; only the close bias ends it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest_tokenizer_helpers import qwen_tokenizer
from engine_helpers import tiny_config
from swarmkv import LLM
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.loader import LoadedModel
from swarmkv.structured import loop_guard
from swarmkv.structured.grammars import json_schema_grammar
from swarmkv.structured.loop_guard import JsonStrings, LoopGuard
from tiny_models import qwen_vocab_size

MARGIN = 8.0
GRAMMAR = json_schema_grammar(
    {
        "type": "object",
        "properties": {"s": {"type": "string"}},
        "required": ["s"],
        "additionalProperties": False,
    }
)


def _guard(tokens: list[int]) -> tuple[int, float] | None:
    guard = LoopGuard()
    guard.add("r")
    guard.extend("r", tokens)
    return guard.penalty("r")


def test_a_loop_is_penalised_from_its_span_on_and_more_each_token() -> None:
    loop = [5, 6] * 40
    assert _guard(loop[: loop_guard.MIN_SPAN - 1]) is None
    assert _guard(loop[: loop_guard.MIN_SPAN]) == (5, loop_guard.MULTIPLIER)  # 6 ended it: 5 continues
    token, amount = _guard(loop[: loop_guard.MIN_SPAN + 3]) or (0, 0.0)
    assert token == 6 and amount == pytest.approx(loop_guard.MULTIPLIER * loop_guard.BASE**3)
    # Long loops: the exponent is capped, so the penalty stays a finite float.
    assert _guard([5, 6] * 3000) == (5, loop_guard.MULTIPLIER * loop_guard.BASE**loop_guard.MAX_EXPONENT)


def test_a_long_period_needs_its_copies_and_a_copy_apart_from_its_source_is_no_loop() -> None:
    sentence = list(range(100, 120))  # 20 tokens
    assert _guard(sentence * 2 + sentence[:19]) is None  # 59 tokens: under 3 periods
    assert _guard(sentence * 3) == (100, loop_guard.MULTIPLIER)
    old = list(range(200, 260))
    assert _guard([1, *old, 2, 3, *old]) is None  # an edit's new text repeating its old text
    assert _guard(list(range(300, 400))) is None


def _one_hot_bigram(classes: list[int]) -> tuple[DecoderForCausalLM, float]:
    """A model with zero attention and MLP, so the residual stream is the last token's class: `classes[i]` is
    class i, every other token the last class. Its LM head is zero (the caller sets it), and the logit
    `scale` a head weight gives is returned beside it."""
    config = tiny_config(vocab_size=qwen_vocab_size())
    model = DecoderForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.norm.weight.fill_(1.0)
        model.embed_tokens.weight[:, len(classes)] = 1.0
        for i, token in enumerate(classes):
            model.embed_tokens.weight[token] = 0.0
            model.embed_tokens.weight[token, i] = 1.0
    model.rotary.build(torch.device("cpu"))
    return model, MARGIN / config.hidden_size**0.5  # the final RMSNorm scales a one-hot by sqrt(hidden)


@cache
def bigram_loaded() -> LoadedModel:
    """The looping bigram: zero attention and MLP, so the residual stream is the last token's class."""
    tok = qwen_tokenizer()
    a, b, quote, brace = (tok.encode(t, add_special_tokens=False) for t in ("A", "B", '"', "}"))
    assert all(len(ids) == 1 for ids in (a, b, quote, brace))
    a_id, b_id, quote_id, brace_id = a[0], b[0], quote[0], brace[0]
    model, scale = _one_hot_bigram([a_id, b_id])  # classes 0 ("A"), 1 ("B"), 2 (any other token)
    with torch.no_grad():
        head = model.lm_head.weight
        head[b_id, 0] = head[a_id, 1] = head[a_id, 2] = scale
        head[quote_id, 0] = head[quote_id, 1] = scale / 2
        head[brace_id, 2] = scale / 4
    return LoadedModel(
        Path("bigram"), "bigram", model.config, model.eval(), tok, torch.float32, torch.device("cpu")
    )


def _prompt() -> list[int]:
    return qwen_tokenizer().encode("Write s.", add_special_tokens=False)


@cache
def _llm(mode: str, jump_forward: str = "auto", speculation: str = "on") -> LLM:
    return LLM(
        loaded=bigram_loaded(),
        kv_cache_memory=16 * 2**20,
        loop_guard=mode,
        jump_forward=jump_forward,
        speculation=speculation,
    )


def _reply(
    mode: str, grammar: str | None = GRAMMAR, jump_forward: str = "auto", speculation: str = "on"
) -> tuple[Any, dict[str, int]]:
    """The reply, and the engine's counters it moved."""
    llm = _llm(mode, jump_forward, speculation)
    before = llm.engine.stats()
    (out,) = llm.generate([_prompt()], SamplingParams(max_tokens=96, temperature=0, grammar=grammar))
    llm.engine.check_integrity()
    after = llm.engine.stats()
    keys = ("loop_guard_penalties", "grammars_compiled", "spec_draft_tokens", "spec_accepted_tokens")
    return out, {k: after[k] - before[k] for k in keys}


def test_without_the_guard_the_bigram_loops_until_max_tokens() -> None:
    out, moved = _reply("off")
    assert out.finish_reason == "length" and "ABABABAB" in out.text
    assert moved["loop_guard_penalties"] == 0


@pytest.mark.parametrize("jump_forward", ["on", "off"])
def test_with_the_guard_the_constrained_reply_leaves_the_loop_and_parses(jump_forward: str) -> None:
    out, moved = _reply("constrained", jump_forward=jump_forward)
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    # The loop ran past its span by the few tokens the penalty took to pass MARGIN / 2.
    assert set(value["s"]) == {"A", "B"} and loop_guard.MIN_SPAN <= len(value["s"]) <= loop_guard.MIN_SPAN + 8
    assert moved["loop_guard_penalties"] > 0 and moved["grammars_compiled"] <= 1


def test_jump_forward_does_not_change_a_guarded_reply() -> None:
    on, _ = _reply("constrained", jump_forward="on")
    off, _ = _reply("constrained", jump_forward="off")
    assert on.token_ids == off.token_ids  # the penalty depends on the reply's tokens alone


def test_the_guard_is_for_constrained_replies_unless_all() -> None:
    out, moved = _reply("constrained", grammar=None)
    assert out.finish_reason == "length" and moved["loop_guard_penalties"] == 0
    assert moved["spec_draft_tokens"] > 0  # unguarded, the loop is drafted from its own text
    out, moved = _reply("all", grammar=None)
    assert moved["loop_guard_penalties"] > 0 and "ABABABAB" * 5 not in out.text


@pytest.mark.parametrize("grammar", [GRAMMAR, None], ids=["constrained", "all"])
@pytest.mark.parametrize("jump_forward", ["on", "off"])
def test_a_guarded_reply_is_drafted_until_its_loop_nears_a_penalty(
    grammar: str | None, jump_forward: str
) -> None:
    mode = "constrained" if grammar is not None else "all"
    on, moved = _reply(mode, grammar, jump_forward, speculation="on")
    off, _ = _reply(mode, grammar, jump_forward, speculation="off")
    assert on.token_ids == off.token_ids  # the rows a draft puts before the guard were free of it
    assert moved["spec_accepted_tokens"] > 0 and moved["loop_guard_penalties"] > 0


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.integers(1, 9), max_size=60),
    tail=st.lists(st.integers(1, 9), min_size=16, max_size=16),
    period=st.integers(1, 12),
)
def test_no_row_a_draft_may_take_is_penalised_or_biased(
    text: list[int], tail: list[int], period: int
) -> None:
    """Whatever the draft, the rows after 0 to `draftable` of its tokens have no penalty and no close bias
    (0: no draft, and no row but the plain step's)."""
    guard = _strings_guard(text)
    looped = _strings_guard(text + tail[:period] * 40)  # past the span: no draft
    assert looped.draftable("r") == 0
    for g in (guard, _strings_guard(text + tail[:period] * 2)):  # a loop's start: the bound bites
        num_tokens = g.draftable("r")
        assert num_tokens is not None
        if not num_tokens:
            continue
        for draft in (tail[:num_tokens], (g._replies["r"].automaton.tokens[-period:] * 16)[:num_tokens]):
            probe = _strings_guard(g._replies["r"].automaton.tokens)
            for token in [None, *draft]:
                if token is not None:
                    probe.extend("r", [token])
                assert probe.penalty("r") is None and probe.closing("r") is None
    assert LoopGuard().draftable("unguarded") is None


def test_no_draft_in_a_string_that_looped_even_behind_an_escaping_backslash() -> None:
    """The close bias hides for the row after a lone backslash and acts again after it, so a draft there
    would take rows the bias applies to (a review found it: greedy output then differed on and off)."""
    guard = _strings_guard([1, *([5, 6] * 20), *range(100, 110), 3])  # looped, broke out, then `\`
    assert guard.closing("r") is None and guard.draftable("r") == 0
    guard.extend("r", [9])
    assert guard.closing("r") is not None and guard.draftable("r") == 0
    guard.extend("r", [1])  # the string closed: drafts again
    assert guard.closing("r") is None and guard.draftable("r") > 0


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="loop_guard"):
        LLM(loaded=bigram_loaded(), kv_cache_memory=16 * 2**20, loop_guard="sometimes")


# A vocabulary for the string tracking: 1 is `"`, 2 `", "` (closes one string, opens the next), 3 `\\`,
# 4 `\\"` (an escaped quote); every other token is text without either.
QUOTING = {1: b'"', 2: b'", "', 3: b"\\", 4: b'\\"'}


def _strings_guard(tokens: list[int]) -> LoopGuard:
    guard = LoopGuard()
    guard.add("r", JsonStrings(1, QUOTING), prefix='{"s": ')
    guard.extend("r", tokens)
    return guard


def test_a_string_looped_in_has_its_quote_raised_until_it_closes() -> None:
    loop = [5, 6] * 20  # spans MIN_SPAN at token 32: tokens 33.. are written in a looped string
    assert _strings_guard([1, *loop[:31]]).closing("r") is None
    guard = _strings_guard([1, *loop])
    written = len(loop) - loop_guard.MIN_SPAN
    amount = loop_guard.MULTIPLIER * loop_guard.BASE ** (written / loop_guard.CLOSE_RATE)
    assert guard.closing("r") == (1, pytest.approx(amount))
    guard.extend("r", [7, 8])  # out of the loop, still in the string: still raised, and more
    assert guard.closing("r")[1] > amount  # type: ignore[index]
    guard.extend("r", [1])  # closed
    assert guard.closing("r") is None
    guard.extend("r", [1, 9])  # a new string has not looped
    assert guard.closing("r") is None


def test_the_string_state_follows_escapes_and_a_token_that_closes_and_opens() -> None:
    loop = [5, 6] * 20
    assert _strings_guard(loop).closing("r") is None  # the loop is outside any string: `{"s": ABAB`
    assert _strings_guard([1, *loop, 2]).closing("r") is None  # `", "`: a new string
    assert _strings_guard([1, *loop, 4]).closing("r") is not None  # `\"` is text in the string
    assert _strings_guard([1, *loop, 3]).closing("r") is None  # after a backslash a quote is text
    assert _strings_guard([1, *loop, 3, 9]).closing("r") is not None
    guard = LoopGuard()
    guard.add("r")  # an unconstrained reply: the penalty only
    guard.extend("r", [1, *loop])
    assert guard.penalty("r") is not None and guard.closing("r") is None


def test_json_strings_finds_the_quote_and_the_quoting_tokens() -> None:
    pieces = [b"a", b'"', b'":', b"\\n", b"b"]
    strings = JsonStrings.of(len(pieces), lambda t: pieces[t])
    assert strings.quote == 1 and set(strings.quoting) == {1, 2, 3}
    with pytest.raises(ValueError, match="quote"):
        JsonStrings.of(1, lambda t: b"a")


@cache
def variant_loaded() -> LoadedModel:
    """A bigram whose broken loop resumes: "A" predicts "B", then "C", then "D" (each a logit below the
    last), and each of those predicts "A". The quote is no likelier than any other token."""
    tok = qwen_tokenizer()
    ids = {t: tok.encode(t, add_special_tokens=False) for t in ("A", "B", "C", "D")}
    assert all(len(v) == 1 for v in ids.values())
    a_id, b_id, c_id, d_id = (ids[t][0] for t in "ABCD")
    model, scale = _one_hot_bigram([a_id])  # classes 0 ("A") and 1 (any other token)
    with torch.no_grad():
        head = model.lm_head.weight
        head[a_id, 1] = scale
        for rank, token in enumerate((b_id, c_id, d_id)):
            head[token, 0] = scale * (1.0 - rank / 8)
    return LoadedModel(
        Path("variants"), "variants", model.config, model.eval(), tok, torch.float32, torch.device("cpu")
    )


def test_a_loop_resumed_in_variants_is_ended_by_closing_its_string(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without closing at the length, so the second reply shows where the cut falls.
    llm = LLM(loaded=variant_loaded(), kv_cache_memory=16 * 2**20, close_at_length=False)
    params = SamplingParams(max_tokens=128, temperature=0, grammar=GRAMMAR)
    before = llm.engine.stats()
    (out,) = llm.generate([_prompt()], params)
    after = llm.engine.stats()
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)["s"]
    assert value.startswith("ABAB") and len(value) <= loop_guard.MIN_SPAN + 24
    assert after["loop_guard_closing"] > before["loop_guard_closing"]
    llm.engine.check_integrity()
    # The penalty alone breaks the loop, and the model resumes it each time until cut.
    monkeypatch.setattr(LoopGuard, "closing", lambda self, request_id: None)
    (cut,) = llm.generate([_prompt()], params)
    assert cut.finish_reason == "length" and cut.text.count("AC") >= 2, cut.text
    assert cut.text.endswith("ABAB" * 2)


def test_a_reply_escaping_in_a_looped_string_is_the_same_with_drafts() -> None:
    """A bigram loops "ABAB" in a string, breaks out with "C", writes the escape `\\n`, and after it the close
    bias decides between "A" (8) and the quote (7); the prompt holds `AC\\nABAB...` to draft from."""
    tok = qwen_tokenizer()
    a, b, c, backslash, n, quote = (
        tok.encode(t, add_special_tokens=False)[0] for t in ("A", "B", "C", "\\", "n", '"')
    )
    model, scale = _one_hot_bigram([a, b, c, backslash, n])  # class 5: any other token
    with torch.no_grad():
        head = model.lm_head.weight
        head[b, 0] = head[a, 1] = scale  # A -> B, B -> A
        head[c, 0] = head[c, 1] = 7 / 8 * scale  # C once the loop is penalised
        head[quote, 0] = head[quote, 1] = 3 / 8 * scale
        head[backslash, 2], head[quote, 2] = scale, 4 / 8 * scale  # C -> backslash
        head[n, 3] = scale  # backslash -> n: the escape `\n`
        head[a, 4], head[quote, 4] = scale, 7 / 8 * scale  # n -> A, or the quote the bias raises
        head[a, 5] = scale
    loaded = LoadedModel(
        Path("escape"), "escape", model.config, model.eval(), tok, torch.float32, torch.device("cpu")
    )
    prompt = _prompt() + [a, c, backslash, n, a, b, a, b, a, b]
    params = SamplingParams(max_tokens=80, temperature=0, grammar=GRAMMAR)
    replies = {}
    for mode in ("off", "on"):
        llm = LLM(loaded=loaded, kv_cache_memory=16 * 2**20, jump_forward="on", speculation=mode)
        (replies[mode],) = llm.generate([prompt], params)
        llm.engine.check_integrity()
    assert replies["on"].token_ids == replies["off"].token_ids
    assert replies["off"].text.endswith('C\\n"}'), replies["off"].text  # the bias closed the string
