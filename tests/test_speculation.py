"""Speculative decoding: suffix automata against brute force, the drafter's sources and scopes, exact greedy
identity with speculation on and off (sharing, preemption, sessions, the C decode step), the target
distribution kept under sampling, and the books after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import checked_generate, tiny_llm
from swarmkv import LLM, SamplingParams
from swarmkv.engine.sampler import probabilities
from swarmkv.engine.speculative import verify_greedy, verify_sampled
from swarmkv.spec import Draft, Drafter, DraftSource
from swarmkv.spec.suffix_automaton import Matcher, SuffixAutomaton

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _occurs_before(text: list[int], length: int, end: int) -> bool:
    return end < len(text) - 1 and text[end - length + 1 : end + 1] == text[len(text) - length :]


def _longest_repeat(text: list[int]) -> int:
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length :]
        if any(text[e - length + 1 : e + 1] == suffix for e in range(length - 1, n - 1)):
            return length
    return 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_repeat_is_the_longest_earlier_suffix(text: list[int]) -> None:
    sam = SuffixAutomaton()
    for i, token in enumerate(text):
        sam.extend(token)
        length, end = sam.repeat()
        assert length == _longest_repeat(text[: i + 1])
        if length:
            assert _occurs_before(text[: i + 1], length, end)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=60))
def test_a_matcher_follows_a_growing_text(ops: list[tuple[bool, int]]) -> None:
    """Interleaved growth of both texts (clones made after a match included): every match it reports is a
    true occurrence."""
    sam, fed = SuffixAutomaton(), list[int]()
    matcher = Matcher(sam)
    for to_text, token in ops:
        if to_text:
            sam.extend(token)
            continue
        matcher.feed(token)
        fed.append(token)
        length, end = matcher.match()
        text = sam.tokens
        if length:
            assert text[end - length + 1 : end + 1] == fed[len(fed) - length :]


def test_drafts_come_from_the_own_context_first() -> None:
    drafter = Drafter(max_draft_tokens=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    drafter.add("a", prompt, None, None)
    draft = drafter.propose("a", 8)
    assert draft is not None and draft.source == "own" and draft.tokens == (3, 4, 5, 6)
    assert drafter.propose("a", 2).tokens == (3, 4)  # type: ignore[union-attr]


def test_siblings_and_sessions_share_only_within_a_salt() -> None:
    drafter = Drafter(max_draft_tokens=4)
    head = list(range(100, 140))
    drafter.add("first", head, "tenant-a", "s1")
    drafter.extend("first", [7, 8, 9, 10, 11, 12])
    drafter.add("sibling", head + [1], "tenant-a", None)
    drafter.add("stranger", head + [1], "tenant-b", None)
    drafter.add("next-turn", [5, 5, 5], "tenant-a", "s1")
    for rid in ("sibling", "stranger", "next-turn"):
        drafter.extend(rid, [7, 8])
    sibling = drafter.propose("sibling", 8)
    assert sibling is not None and sibling.source == "sibling" and sibling.tokens[:2] == (9, 10)
    assert drafter.propose("stranger", 8) is None  # another tenant's reply is never a source
    session = drafter.propose("next-turn", 8)
    assert session is not None and session.source == "session" and session.tokens[:2] == (9, 10)
    drafter.finish("first")  # a finished reply stays a source
    drafter.extend("sibling", [9, 10])
    assert drafter.propose("sibling", 8).tokens[:2] == (11, 12)  # type: ignore[union-attr]


def test_sources_left_out_lend_nothing() -> None:
    """draft_sources: without sibling a head's other replies are no source, without session its earlier turns
    are none, without own the request's context is none; the sources kept still draft."""
    head = list(range(100, 140))

    def drafts(sources: tuple[DraftSource, ...]) -> dict[str, Draft | None]:
        drafter = Drafter(max_draft_tokens=4, sources=sources)
        drafter.add("first", head, "salt", "s1")
        drafter.extend("first", [7, 8, 9, 10, 11, 12])
        drafter.add("sibling", head + [1], "salt", None)
        drafter.add("next-turn", [5, 5, 5], "salt", "s1")
        drafter.add("repeats", [1, 2, 3, 4, 5, 6, 1, 2], "salt", None)
        for rid in ("sibling", "next-turn"):
            drafter.extend(rid, [7, 8])
        return {rid: drafter.propose(rid, 8) for rid in ("sibling", "next-turn", "repeats")}

    every = drafts(("own", "sibling", "session"))
    assert [d.source if d else None for d in every.values()] == ["sibling", "session", "own"]
    assert drafts(("own", "session"))["sibling"] is None
    assert drafts(("own", "sibling"))["next-turn"] is None
    no_own = drafts(("sibling", "session"))
    assert no_own["repeats"] is None and no_own["sibling"] is not None and no_own["next-turn"] is not None


def test_failed_drafts_back_off_and_accepted_ones_grow() -> None:
    drafter = Drafter(max_draft_tokens=8)
    drafter.add("a", [1, 2, 3, 4, 5, 6, 1, 2], None, None)
    first = drafter.propose("a", 8)
    assert first is not None and first.tokens == (3, 4, 5, 6)  # the first draft's length, 4
    assert drafter.record("a", 4, 4) == "own"
    assert len(drafter.propose("a", 8).tokens) == 8  # type: ignore[union-attr]
    drafter.record("a", 8, 0)
    assert drafter.propose("a", 8) is None  # one step of back-off after a miss
    assert drafter.propose("a", 8) is not None
    drafter.record("a", 1, 0)
    assert [drafter.propose("a", 8) for _ in range(3)] == [None] * 3  # then three


def test_a_vetoed_draft_is_not_a_miss() -> None:
    """A draft the engine's vet cuts to nothing (a grammar's forced run waiting, a loop near the guard) leaves
    the request as it was: idle proposals make it skip later ones (under async scheduling), vetoes do not."""
    allowed = {"a": 0}
    drafter = Drafter(max_draft_tokens=8, idle_wait_steps=4, vet=lambda rid, tokens: allowed[rid])
    drafter.add("a", [1, 2, 3, 4, 5, 6, 1, 2], None, None)
    assert [drafter.propose("a", 8) for _ in range(3)] == [None] * 3
    allowed["a"] = 2
    draft = drafter.propose("a", 8)  # no skipped proposals: it drafts at once, cut to what the vet allows
    assert draft is not None and draft.tokens == (3, 4)
    drafter.add("b", [7, 8, 9], None, None)  # matches nothing: idle, so the next ones are skipped
    allowed["b"] = 8
    assert drafter.propose("b", 8) is None and drafter.backing_off("b")


def test_a_draft_is_as_long_as_its_match() -> None:
    """A partial acceptance cuts the next draft to what was accepted plus one, unless the match it continues
    is longer: a long match is a copy under way."""
    drafter = Drafter(max_draft_tokens=8)
    text = list(range(10, 30))
    drafter.add("a", [*text, *text[:3]], None, None)
    first = drafter.propose("a", 16)
    assert first is not None and first.match_tokens == 3 and first.tokens == tuple(text[3:7])
    drafter.record("a", 4, 1)  # one accepted: the next draft is cut to 2 tokens
    drafter.extend("a", text[3:5])
    assert drafter.propose("a", 16).tokens == tuple(text[5:10])  # type: ignore[union-attr]  # match of 5
    drafter.record("a", 5, 0)  # none accepted: cut to 1
    assert drafter.propose("a", 16) is None  # the step of back-off after a miss
    drafter.extend("a", [99, 10, 11])  # a new match of 2 tokens: 2 drafted, not the cap's 8
    assert drafter.propose("a", 16).tokens == (12, 13)  # type: ignore[union-attr]


def test_a_copy_left_at_one_token_resumes_past_it() -> None:
    """An edit renames a name: the reply follows the file, writes another token in place of one, and goes on
    copying. After 3 or more accepted tokens the next draft resumes past the replaced token; after fewer, a
    rejection is only a miss."""
    text = list(range(10, 40))
    for accepted, resumed in ((3, True), (2, False)):
        drafter = Drafter(max_draft_tokens=8)
        drafter.add("a", [*text, 99, *text[:6]], None, None)
        draft = drafter.propose("a", 8)
        assert draft is not None and draft.tokens == tuple(text[6:12])  # as long as its match of 6
        drafter.record("a", 6, accepted)
        drafter.extend("a", [*text[6 : 6 + accepted], 77])  # 77 in place of the copy's next token
        after = drafter.propose("a", 8)
        if resumed:
            skip = 6 + accepted + 1
            assert (
                after is not None and after.source == "own" and after.tokens == tuple(text[skip : skip + 8])
            )
        else:
            assert after is None  # [..., 77] matches nothing
        assert drafter.propose("a", 8) is None  # a resume is offered to one proposal only


def test_a_resume_is_dropped_by_a_step_without_drafts_and_never_copies_the_reply() -> None:
    """A resume follows the rejected draft's yield only: a plain step between (the scheduler had no room for a
    draft) leaves it behind the reply. And an own copy that ran into the reply itself (a repeating pattern)
    has no copied text past the replaced token to resume."""
    text = list(range(10, 40))
    drafter = Drafter(max_draft_tokens=8)
    drafter.add("a", [*text, 99, *text[:6]], None, None)
    assert drafter.propose("a", 8) is not None
    drafter.record("a", 6, 3)
    drafter.extend("a", [*text[6:9], 77])
    drafter.extend("a", [text[10]])  # a plain step: the request decoded one token without a draft
    assert drafter.propose("a", 8) is None

    looping = Drafter(max_draft_tokens=8)
    looping.add("b", [5, 6, 7, 1, 1, 1, 1], None, None)
    draft = looping.propose("b", 4)
    assert draft is not None and draft.tokens == (1, 1, 1, 1)  # the overlapping copy runs past the text
    looping.record("b", 4, 3)
    looping.extend("b", [1, 1, 1, 2])
    assert looping.propose("b", 8) is None  # nothing but the reply's own 2s past the replaced token


def test_greedy_verification_keeps_the_argmax_run() -> None:
    assert verify_greedy([5, 6, 9, 1], (5, 6, 7)) == [5, 6, 9]
    assert verify_greedy([4, 0], (5,)) == [4]
    assert verify_greedy([5, 6, 7, 8], (5, 6, 7)) == [5, 6, 7, 8]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """The first token out of a verified draft is distributed as p, whatever the draft: a deterministic
    generator, so this cannot flake."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4)
    target = probabilities(logits[:1], params)[0].double()
    generator = torch.Generator().manual_seed(1)
    trials = 20000
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(trials):
        counts[verify_sampled(logits, (int(target.argmax()),), params, generator)[0]] += 1
    assert (counts / trials - target).abs().max() < 0.015
    assert counts[target == 0].sum() == 0  # a token top-p removed is never drawn


def _repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """A shared head, then a text of each prompt's own said three times: drafts from its own context."""
    rng = random.Random(seed)
    head = [rng.randrange(256) for _ in range(40)]
    prompts = []
    for _ in range(count):
        text = [rng.randrange(256) for _ in range(40)]
        prompts.append(head + text * 3 + [rng.randrange(256) for _ in range(4)])
    return prompts


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"prefix_caching": False},
        {"kv_cache_memory": 340 * 2**10, "block_size": 8},  # preemption: the pool holds two of the six
        {"max_num_batched_tokens": 24, "block_size": 4},  # chunked prefills beside drafts, small pages
    ],
    ids=["shared", "per-slot", "preempting", "chunked"],
)
def test_greedy_output_is_identical_with_speculation_on(options: dict[str, object]) -> None:
    prompts = _repetitive_prompts(0, 6)
    off = checked_generate(tiny_llm(speculation="off", **options), prompts, GREEDY)
    llm = tiny_llm(speculation="on", **options)
    on = checked_generate(llm, prompts, GREEDY)
    assert on == off
    stats = llm.engine.snapshot()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert stats.generated_tokens == sum(len(o) for o in on)
    assert stats.steps < stats.generated_tokens  # fewer steps than tokens
    if "kv_cache_memory" in options:
        assert stats.preemptions > 0
    kv = llm.engine.core.kv
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages  # nothing leaked


def test_sessions_and_siblings_draft_and_stay_exact() -> None:
    prompts = _repetitive_prompts(1, 4)
    runs = {}
    for mode in ("off", "on"):
        llm = tiny_llm(speculation=mode)
        first = checked_generate(llm, prompts[:1], GREEDY, session_id="s")
        # The next turn continues the first; its reply repeats the first's text, a session draft source.
        second = checked_generate(llm, [prompts[0] + first[0] + [7]], GREEDY, session_id="s")
        swarm = checked_generate(llm, prompts[1:], GREEDY)
        runs[mode] = (first, second, swarm, llm.engine.snapshot())
    assert runs["on"][:3] == runs["off"][:3]
    stats = runs["on"][3]
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_sibling_tokens + stats.spec_accepted_session_tokens > 0


def test_sampling_with_drafts_runs_and_a_seed_reproduces() -> None:
    llm = tiny_llm(speculation="on")
    prompts = _repetitive_prompts(2, 3)
    sampled = SamplingParams(max_tokens=32, temperature=0.7, ignore_eos=True)
    outs = checked_generate(llm, prompts, sampled)
    assert all(len(o) == 32 for o in outs)
    seeded = SamplingParams(max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)
    again = [checked_generate(llm, prompts[:1], seeded)[0] for _ in range(2)]
    assert again[0] == again[1]  # a seeded request is not drafted: its draws never depend on others' text


def test_max_tokens_and_stop_ids_hold_inside_an_accepted_draft() -> None:
    prompts = _repetitive_prompts(3, 2)
    off = checked_generate(tiny_llm(speculation="off"), prompts, GREEDY)
    stop = off[0][20]
    for params in (
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
    ):
        assert checked_generate(tiny_llm(speculation="on"), prompts, params) == checked_generate(
            tiny_llm(speculation="off"), prompts, params
        )


def test_hybrids_speculate_on_the_torch_backend(tmp_path: Path) -> None:
    """auto and on alike (tests/test_speculation_hybrid.py checks them exact; triton refuses `on`)."""
    from tiny_gguf import Q, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "q35.gguf", "qwen35", projections=Q.Q8_0)
    for mode in ("auto", "on"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", speculation=mode)
        assert llm.engine.drafter is not None, mode


def test_the_c_decode_step_verifies_drafts_exactly(tmp_path: Path) -> None:
    """A draft as one C row per position, on float32 activations: greedy identical to decoding without."""
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    prompts = _repetitive_prompts(4, 4)
    outs = {}
    for mode in ("off", "on"):
        llm = LLM(
            str(path), dtype="float32", kv_cache_memory="64MiB", speculation=mode, cpu_int8_activations=False
        )
        assert llm.engine.runner.cpu_decode is not None
        outs[mode] = checked_generate(llm, prompts, GREEDY)
        if mode == "on":
            assert llm.engine.snapshot().spec_accepted_tokens > 0
    assert outs["on"] == outs["off"]


def test_kept_replies_stay_bounded_as_heads_and_sessions_come_and_go() -> None:
    drafter = Drafter()
    drafter.max_groups = drafter.max_sessions = 4
    for i in range(50):
        drafter.add(f"r{i}", [i] * 40, "salt", f"s{i}")
        drafter.extend(f"r{i}", [1, 2, 3])
        drafter.finish(f"r{i}")
    assert len(drafter._groups) <= 5 and len(drafter._sessions) <= 5
    drafter.add("live", [7] * 40, "salt", None)
    drafter.add("other", [7] * 40 + [1], "salt", None)
    drafter.extend("live", [4, 5, 6, 4, 5])
    drafter.extend("other", [4, 5])
    assert drafter.propose("other", 4) is not None  # a live head's pool is never the one dropped


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("speculation", "sometimes"),
        ("max_speculative_rows", -1),
        ("num_speculative_tokens", 0),
        ("draft_sources", ("own", "siblings")),
        ("draft_sources", "own"),  # a string is not a tuple of sources
        ("speculative_method", "draft-model"),
        ("num_mtp_tokens", 0),
        ("num_mtp_tokens", True),
    ],
)
def test_bad_speculation_settings_are_refused(option: str, value: object) -> None:
    from swarmkv.core.config import EngineConfig

    with pytest.raises(ValueError, match=option):
        EngineConfig(**{option: value})  # type: ignore[arg-type]


def test_a_stop_string_inside_an_accepted_draft_ends_the_reply_at_its_token() -> None:
    """One token a step stops at the token that completes a stop string; a draft accepted past it must too:
    the same tokens, the same usage, nothing past the stop left in the reply."""
    prompts = _repetitive_prompts(4, 1)
    llm = tiny_llm(speculation="on")
    tokenizer = llm.tokenizer
    llm.engine.add_request("probe", prompts[0], GREEDY)
    reply: list[int] = []
    inside = None  # a reply index inside a multi-token delta, not its last
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            if inside is None and len(delta.new_token_ids) >= 3 and len(reply) >= 8:
                inside = len(reply) + 1
            reply += delta.new_token_ids
    assert inside is not None, "no accepted draft of 3 tokens to stop inside"
    text, upto = tokenizer.decode(reply), tokenizer.decode(reply[: inside + 1])
    stop = next(
        upto[-n:]
        for n in range(2, len(upto))
        if text.find(upto[-n:]) == len(upto) - n and not tokenizer.decode(reply[:inside]).endswith(upto[-n:])
    )
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,))
    results = {}
    for mode in ("off", "on"):
        run = tiny_llm(speculation=mode)
        tokens = checked_generate(run, prompts, params)[0]
        results[mode] = (tokens, run.engine.snapshot().generated_tokens)
    assert results["on"] == results["off"]
    assert len(results["off"][0]) == inside + 1  # it stopped at the token that completed the stop string
