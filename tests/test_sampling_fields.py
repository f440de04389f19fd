"""OpenAI's sampling fields mean what they mean (issue 53): `logit_bias` moves the logits on every sampling
path (greedy, sampled, a draft's verification, under a grammar's mask) and refuses ids past the vocabulary
and values past [-100, 100]; `min_p`, the presence, frequency and repetition penalties match a plain torch
reference of vLLM's definitions; NaN (and infinities where they mean nothing) is a 400 on every route;
`/v1/completions` defaults `max_tokens` to 16."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine_helpers import tiny_llm
from swarmkv import LLM
from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.completion_request import parse_completion_request
from swarmkv.api.errors import APIError
from swarmkv.core.processors import LogitRows
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import Sequence
from swarmkv.engine.logit_adjustments import LogitAdjustments
from swarmkv.engine.sampler import probabilities
from swarmkv.errors import InvalidRequestError
from swarmkv.models.loader import load_model
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.structured.grammars import json_schema_grammar

USER = [{"role": "user", "content": "Hello"}]


def _reference(
    logits: torch.Tensor, prompt: list[int], reply: list[int], params: SamplingParams
) -> torch.Tensor:
    """vLLM's definitions, one token at a time: bias, then repetition over the prompt and the reply, then
    frequency and presence over the reply."""
    x = logits.clone()
    for token, value in params.logit_bias:
        x[token] += value
    for token in set(prompt) | set(reply):
        rep = params.repetition_penalty
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(reply):
        x[token] -= params.frequency_penalty * reply.count(token) + params.presence_penalty
    return x


def test_penalties_and_bias_match_the_reference_on_every_row_a_draft_included() -> None:
    vocab = 50
    torch.manual_seed(0)
    cases = [
        (SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), [1, 2, 3], [4, 4, 5], ()),
        (
            SamplingParams(repetition_penalty=1.8, logit_bias={7: -3.5, 49: 2.0}),
            [7, 8, 8, 9],
            [10, 7],
            (11, 7),
        ),
        (SamplingParams(temperature=0), [1], [2], ()),  # asks for nothing: its row stays as it was
        (SamplingParams(repetition_penalty=0.5, frequency_penalty=-1.0), [3, 3], [], ()),
    ]
    adjust = LogitAdjustments(vocab)
    chunks = []
    for i, (params, prompt, reply, draft) in enumerate(cases):
        seq = Sequence(f"r{i}", prompt, params, output_token_ids=list(reply))
        adjust.added(seq)
        chunks.append(
            Chunk(seq, len(prompt) + len(reply) - 1, [seq.token_ids[-1], *draft], "decode", True, draft=draft)
        )
    logits = torch.randn(sum(c.num_logits for c in chunks), vocab, dtype=torch.float32) * 3
    logits[0, 4] = float("-inf")  # a grammar's ban stays a ban
    expected = []
    for (params, prompt, reply, draft), chunk in zip(cases, chunks, strict=True):
        for i in range(chunk.num_logits):
            row = len(expected)
            expected.append(_reference(logits[row], prompt, reply + list(draft[:i]), params))
    adjust.logits(LogitRows(chunks, logits))
    torch.testing.assert_close(logits, torch.stack(expected))
    assert logits[0, 4] == float("-inf")
    assert adjust.needs_ids("r0") and not adjust.needs_ids("r2")


def test_min_p_keeps_tokens_within_its_share_of_the_top_probability() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40) * 2
    params = SamplingParams(temperature=0.7, min_p=0.2)
    probs = torch.softmax(logits / 0.7, dim=-1)
    kept = probs >= 0.2 * probs.max(dim=-1, keepdim=True).values
    expected = torch.where(kept, probs, 0.0)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(probabilities(logits, params).float(), expected)
    assert torch.equal(probabilities(logits, SamplingParams(temperature=0.7, min_p=0.0)) > 0, probs > 0)


def test_logit_bias_steers_greedy_sampled_and_speculative_replies() -> None:
    llm = tiny_llm(speculation="on")
    target = 242
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    for params in (
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={target: 100}),
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={target: 100}),
    ):
        (out,) = llm.generate([prompt], params)
        assert out.token_ids == [target] * 6
    # A ban: the unbiased greedy reply's first token never comes.
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    banned = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={free.token_ids[0]: -100}
    )
    (out,) = llm.generate([prompt], banned)
    assert free.token_ids[0] not in out.token_ids
    llm.engine.check_integrity()


def test_penalised_greedy_replies_are_the_same_with_drafts_verified() -> None:
    """A draft's rows are penalised as the decode that would have produced them: the same tokens."""
    prompt = [21, 22, 23, 24, 21, 22, 23, 24, 21, 22, 23, 24, 21, 22]
    params = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=0.4, repetition_penalty=1.3
    )
    plain = tiny_llm(speculation="off")
    drafting = tiny_llm(speculation="on")
    for llm in (plain, drafting):  # a second round drafts from the first's reply
        llm.generate([prompt], params)
    (a,) = plain.generate([prompt], params)
    before = drafting.engine.stats()["spec_draft_tokens"]
    (b,) = drafting.generate([prompt], params)
    assert drafting.engine.stats()["spec_draft_tokens"] > before
    assert a.token_ids == b.token_ids
    (unpenalised,) = plain.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert unpenalised.token_ids != a.token_ids


def test_a_bias_cannot_lift_a_token_the_grammar_bans() -> None:
    from test_structured import _prompts, tiny_qwen_loaded

    llm = LLM(loaded=tiny_qwen_loaded(), kv_cache_memory=32 * 2**20)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    x_id = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(
        max_tokens=12, temperature=0, grammar=json_schema_grammar(schema), logit_bias={x_id: 100}
    )
    (out,) = llm.generate(_prompts()[:1], params)
    assert x_id not in out.token_ids
    assert isinstance(json.loads(out.text)["n"], int)


def test_a_bias_on_an_id_past_the_vocabulary_is_refused() -> None:
    llm = tiny_llm()
    vocab = llm.loaded.config.vocab_size
    (refused,) = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert refused.error is not None and "logit_bias" in refused.error and not refused.token_ids
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.engine.add_request("far", [1, 2], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    (out,) = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0}))
    assert out.error is None and len(out.token_ids) == 2


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"5": NAN}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"min_p": NAN}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": INF}, "frequency_penalty"),
        ({"temperature": NAN}, "temperature"),
        ({"top_p": NAN}, "top_p"),
    ],
)
def test_out_of_range_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    for parse, body in (
        (parse_chat_request, {"messages": USER}),
        (parse_completion_request, {"prompt": "x"}),
    ):
        with pytest.raises(APIError) as caught:
            parse({**body, **fields})
        assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize(
    "fields",
    [{"min_p": NAN}, {"repetition_penalty": NAN}, {"presence_penalty": INF}, {"logit_bias": {"1": NAN}}],
)
def test_sampling_params_refuse_nan_and_meaningless_infinities(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**fields)


def test_the_fields_reach_the_engine_settings() -> None:
    body = {
        "messages": USER,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {"9": -100, "3": 2.5},
    }
    params = parse_chat_request(body).options.sampling_params(3, 100, "messages")
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.05, 0.5, -0.25)
    assert params.repetition_penalty == 1.1 and params.logit_bias == ((3, 2.5), (9, -100.0))
    assert parse_completion_request({"prompt": "x"}).options.max_tokens == 16
    assert parse_chat_request({"messages": USER}).options.max_tokens is None  # chat: the context's room


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path) -> Iterator[tuple[str, LLM]]:
    llm = LLM(loaded=load_model(scripted_model_dir, dtype="float32"), kv_cache_memory="16MiB", max_num_seqs=4)
    with BackgroundServer(create_app(llm, ServerConfig())) as server:
        yield server.url, llm


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    # `json.dumps` writes NaN and Infinity as JavaScript does, which Python's decoder (and so the server) reads.
    raw = json.dumps(body).encode()
    return httpx.post(f"{url}{route}", content=raw, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "min_p": NAN}, "min_p"),
        ("/v1/chat/completions", {"messages": USER, "repetition_penalty": NAN}, "repetition_penalty"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"3": 100.5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "min_p": NAN}, "min_p"),
        ("/v1/completions", {"prompt": "Hi", "frequency_penalty": NAN}, "frequency_penalty"),
        ("/v1/messages", {"messages": USER, "max_tokens": 4, "temperature": NAN}, "temperature"),
        ("/v1/messages", {"messages": USER, "max_tokens": 4, "top_p": NAN}, "top_p"),
        ("/v1/responses", {"input": "Hi", "temperature": NAN}, "temperature"),
        ("/v1/responses", {"input": "Hi", "top_p": INF}, "top_p"),
    ],
)
def test_nan_is_a_400_on_every_route(
    served: tuple[str, LLM], route: str, body: dict[str, Any], param: str
) -> None:
    response = _post(served[0], route, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"].get("param") in (param, None), response.text
    assert param in response.text


def test_a_bias_past_the_vocabulary_is_a_400_and_one_inside_it_steers(served: tuple[str, LLM]) -> None:
    url, llm = served
    far = _post(url, "/v1/chat/completions", {"messages": USER, "logit_bias": {"999999999": 1}})
    assert far.status_code == 400 and "logit_bias" in far.text
    target = llm.tokenizer.encode("q", add_special_tokens=False)[0]
    body = {
        "prompt": "Hi",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(target): 100},
    }
    steered = _post(url, "/v1/completions", body)
    assert steered.status_code == 200, steered.text
    assert steered.json()["choices"][0]["text"] == llm.tokenizer.decode([target] * 5)


def test_completions_default_to_16_tokens(served: tuple[str, LLM]) -> None:
    response = _post(served[0], "/v1/completions", {"prompt": "Hi", "ignore_eos": True})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "length"
    assert not math.isnan(reply["usage"]["completion_tokens"])
