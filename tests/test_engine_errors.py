"""Bad requests fail alone, with typed errors, and never leak pages or stop the others."""

from __future__ import annotations

import pytest

from engine_helpers import tiny_llm
from swarmkv import LLM, SamplingParams
from swarmkv.errors import CapacityError, InvalidRequestError

OK = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_overlong_prompt_fails_alone_in_generate() -> None:
    llm = tiny_llm(max_model_len=128)
    good, bad, good2 = llm.generate([[1, 2, 3], list(range(200)), [4, 5, 6]], OK)
    assert bad.error is not None and "context" in bad.error and bad.token_ids == []
    assert good.error is None and len(good.token_ids) == 4
    assert good2.error is None and len(good2.token_ids) == 4
    assert llm.stats()["kv_pages_in_use"] == 0
    llm.engine.check_integrity()


def test_prompt_longer_than_the_pool_is_refused_while_others_run() -> None:
    llm = tiny_llm(kv_cache_memory=40 * 16 * 2 * 2 * 2 * 16 * 8, max_model_len=2000)  # 640 tokens of pool
    engine = llm.engine
    engine.add_request("ok", [1, 2, 3], OK)
    engine.step()
    with pytest.raises(InvalidRequestError, match="pool"):
        engine.add_request("big", list(range(300)) * 2 + [1] * 50, OK)
    assert engine.get_sequence("big") is None
    while engine.has_unfinished():
        engine.step()
    assert llm.stats()["requests_finished"] == 1
    engine.check_integrity()


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": 0},
        {"stop": [""]},
    ],
)
def test_bad_sampling_values_are_typed_errors(fields: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**fields)


def test_unknown_sampling_field_is_an_error() -> None:
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams.from_dict({"max_tokens": 3, "best_of": 2})


@pytest.mark.parametrize("prompt", [[], [10**9], [-1]])
def test_bad_token_ids_are_refused(prompt: list[int]) -> None:
    llm = tiny_llm()
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request("x", prompt, OK)
    assert not llm.engine.has_unfinished()


def test_duplicate_request_id_is_refused() -> None:
    llm = tiny_llm()
    llm.engine.add_request("same", [1, 2], OK)
    with pytest.raises(InvalidRequestError, match="already"):
        llm.engine.add_request("same", [3, 4], OK)


def test_pool_too_small_for_one_request_is_a_clear_error_at_start() -> None:
    with pytest.raises(CapacityError, match="kv_cache_memory"):
        LLM(loaded=tiny_llm().loaded, kv_cache_memory="20KiB")


def test_abort_releases_pages() -> None:
    llm = tiny_llm()
    engine = llm.engine
    engine.add_request("a", list(range(100)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(50)), OK)
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert llm.stats()["kv_pages_in_use"] == 0


def test_stop_strings_and_stop_tokens() -> None:
    llm = tiny_llm()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (free,) = llm.generate([[5, 6, 7]], params)
    stop_at = free.token_ids[3]
    (by_id,) = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_at,))
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == stop_at
    assert len(by_id.token_ids) == free.token_ids.index(stop_at) + 1
    needle = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    (by_text,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, stop=[needle]))
    assert by_text.finish_reason == "stop" and needle not in by_text.text
    assert free.text.startswith(by_text.text)
    assert free.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_differs_from_greedy() -> None:
    llm = tiny_llm()
    params = SamplingParams(temperature=1.5, top_p=0.9, top_k=50, seed=123, max_tokens=16, ignore_eos=True)
    a, b = llm.generate([[1, 2, 3], [1, 2, 3]], params)
    assert a.token_ids == b.token_ids
    (greedy,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert a.token_ids != greedy.token_ids


def test_tiny_temperature_is_greedy_not_a_crash() -> None:
    llm = tiny_llm()
    (tiny,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True))
    (greedy,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_out_of_range_seed_is_a_typed_error(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


def test_max_model_len_beyond_the_model_is_refused() -> None:
    with pytest.raises(CapacityError, match="max_model_len"):
        tiny_llm(max_model_len=10**6)


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "block_size"])
def test_zero_budgets_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_llm(**{field: 0})


def test_stop_string_inside_a_long_new_piece_is_cut() -> None:
    llm = tiny_llm()
    engine = llm.engine
    engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=5, stop=("----",)))
    outputs = engine.outputs
    state = outputs._states["s"]
    state.text = "abc"
    assert outputs._scan_for_stop_string(state) is None
    state.text += "x" * 40 + "-" * 32  # one step adding far more text than the longest stop string
    assert outputs._scan_for_stop_string(state) == (43, "----")


def test_unknown_engine_options_and_cascade_modes_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown engine option.*kv_cach_memory"):
        tiny_llm(kv_cach_memory="1GiB")
    with pytest.raises(ValueError, match="cascade_attention"):
        tiny_llm(cascade_attention="sometimes")
    with pytest.raises(ValueError, match="cascade_attention"):
        tiny_llm(cascade_attention=False)  # the bool switch this setting replaced is gone
    with pytest.raises(ValueError, match="starvation_steps"):
        tiny_llm(starvation_steps=0)
