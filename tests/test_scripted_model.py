"""The scripted checkpoint (tests/scripted_model.py): its greedy replies are the script, exactly, on any machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from scripted_model import (
    ANSWER,
    END_OF_TURN,
    FORCED_CALL_TAIL,
    MARGIN,
    SCRIPT,
    WEATHER_CALL,
    ScriptedArch,
    Vocabulary,
    make_scripted_checkpoint,
)
from swarmkv import LLM
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.models.attention import CausalSelfAttention
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer

Message = dict[str, Any]

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} in a city", "parameters": CITY_SCHEMA},
    }
    for name in ("get_weather", "get_time")
]
SYSTEM: Message = {"role": "system", "content": "You answer questions about cities using the tools."}
QUESTION: Message = {"role": "user", "content": "What is the weather and the time in Paris?"}


def _call(call_id: str, name: str) -> dict[str, Any]:
    arguments = json.dumps({"city": "Paris"})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLED: list[Message] = [
    SYSTEM,
    QUESTION,
    {"role": "assistant", "content": "", "tool_calls": [_call("c1", "get_weather")]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
]
CALLED_TWICE: list[Message] = [
    *CALLED,
    {"role": "assistant", "content": "", "tool_calls": [_call("c2", "get_time")]},
    {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
]
# Two results of one turn's parallel calls, rendered in one user turn.
PARALLEL: list[Message] = [
    QUESTION,
    {"role": "assistant", "content": "", "tool_calls": [_call("c1", "get_weather"), _call("c2", "get_time")]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
]
NEXT_QUESTION: list[Message] = [
    *CALLED,
    {"role": "assistant", "content": ANSWER},
    {"role": "user", "content": "And in Rome?"},
]


@pytest.fixture(scope="module")
def scripted(scripted_model_dir: Path) -> LoadedModel:
    return load_model(scripted_model_dir, dtype="float32")


def _cases(tokenizer: Any) -> list[tuple[str, list[int], str]]:
    """Eight prompts (name, ids, the reply's expected text) covering every branch of the script."""

    def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = TOOLS) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=tools))

    forced = '<tool_call>\n{"name": "get_time", "arguments": {"city": "'
    prompts = [
        ("question", chat([SYSTEM, QUESTION]), WEATHER_CALL),
        ("a tool result", chat(CALLED), ANSWER),
        ("two tool results", chat(CALLED_TWICE), ANSWER),
        ("parallel results", chat(PARALLEL), ANSWER),
        ("a tool result, no tools", chat(CALLED, tools=None), ANSWER),
        ("the next question", chat(NEXT_QUESTION), WEATHER_CALL),
        ("a forced call", chat(CALLED) + forced, FORCED_CALL_TAIL),
        ("a required call", chat([QUESTION]) + '<tool_call>\n{"name": "', WEATHER_CALL.split('"name": "')[1]),
    ]
    return [(name, tokenizer.encode(text), reply) for name, text, reply in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_greedy_reply_is_the_script_in_a_batch_of_eight(
    scripted: LoadedModel, prefix_caching: bool
) -> None:
    llm = LLM(loaded=scripted, kv_cache_memory="16MiB", max_num_seqs=8, prefix_caching=prefix_caching)
    cases = _cases(llm.tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    end_of_turn = llm.tokenizer.token_to_id(END_OF_TURN)
    for attempt in range(2):  # the second batch meets the first one's pages, when caching is on
        outputs = llm.generate([ids for _, ids, _ in cases], greedy)
        for (name, _, reply), out in zip(cases, outputs, strict=True):
            assert (out.text, out.finish_reason, out.token_ids[-1]) == (reply, "stop", end_of_turn), name
            if not prefix_caching:
                assert out.num_cached_tokens == 0, name
            elif attempt:
                assert out.num_cached_tokens > 0, name
    llm.engine.check_integrity()


def test_every_greedy_choice_has_the_margin(scripted: LoadedModel) -> None:
    # Logits at every position of long prompts and their replies: each token predicts its scripted successor
    # (the end of turn for all others) by MARGIN over every other token, whatever came before it.
    assert scripted.dtype == torch.float32
    tokenizer = scripted.tokenizer
    end_of_turn = tokenizer.encode(END_OF_TURN)
    for name, ids, reply in _cases(tokenizer):
        ids = ids + tokenizer.encode(reply) + end_of_turn
        with torch.inference_mode():
            hidden = scripted.model(torch.tensor(ids), torch.arange(len(ids)), CausalSelfAttention())
            top = scripted.model.compute_logits(hidden).topk(2, dim=-1)
        expected = [tokenizer.encode(SCRIPT.get(tokenizer.id_to_token(i) or "", END_OF_TURN)) for i in ids]
        assert [[i] for i in top.indices[:, 0].tolist()] == expected, name
        margins = top.values[:, 0] - top.values[:, 1]
        assert margins.min().item() >= 0.999 * MARGIN, (name, margins.min().item())
        assert top.values[:, 1].abs().max().item() == 0.0, name  # every other logit is exactly zero


def test_transformers_reads_the_same_model(scripted_model_dir: Path, scripted: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer: Any = AutoTokenizer.from_pretrained(str(scripted_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(scripted_model_dir), dtype=torch.float32).eval()
    messages = CALLED
    text = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == scripted.tokenizer.apply_chat_template(messages, tools=TOOLS)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == scripted.tokenizer.encode(text)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert hf_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True) == ANSWER


@pytest.mark.e2e
def test_the_server_parses_the_scripted_call_and_answer(scripted: LoadedModel) -> None:
    llm = LLM(loaded=scripted, kv_cache_memory="16MiB", max_num_seqs=4)
    with BackgroundServer(create_app(llm)) as server:

        def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            body = {"model": scripted.name, "messages": messages, "tools": TOOLS, "temperature": 0, **extra}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return dict(response.json()["choices"][0])

        first = chat([SYSTEM, QUESTION])
        assert first["finish_reason"] == "tool_calls"
        (call,) = first["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        forced = chat(CALLED, tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = forced["message"]["tool_calls"]
        assert call["function"] == {"name": "get_time", "arguments": '{"city": "Paris"}'}
        answer = chat(CALLED_TWICE)
        assert (answer["finish_reason"], answer["message"]["content"]) == ("stop", ANSWER)


@pytest.mark.e2e
@pytest.mark.slow  # a fresh interpreter imports torch and the server
def test_swarmkv_serve_loads_it_like_any_model(scripted_model_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "swarmkv.cli",
        "serve",
        "--model",
        str(scripted_model_dir),
        "--port",
        "0",
    ]
    server = subprocess.Popen(
        [*command, "--kv-cache-memory", "16MiB"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        assert server.stderr is not None
        url = None
        for line in server.stderr:  # uvicorn names the port it bound
            if found := re.search(r"Uvicorn running on (http://\S+)", line):
                url = found.group(1)
                break
        assert url is not None, f"the server exited with {server.wait()}"
        body = {"model": scripted_model_dir.name, "messages": [QUESTION], "tools": TOOLS, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        (call,) = reply["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize(("vocabulary", "arch"), [("qwen3", "llama"), ("qwen3", "qwen3_5")])
def test_the_script_holds_on_the_qwen3_vocabulary_and_in_a_hybrid(
    tmp_path: Path, vocabulary: Vocabulary, arch: ScriptedArch
) -> None:
    # The e2e tests' variants: Qwen3's merges (a harness prompt in 4x fewer tokens) and a Qwen3.5 hybrid,
    # whose recurrent states are carried and restored from the prefix cache without changing a logit.
    folder = make_scripted_checkpoint(tmp_path / "scripted", vocabulary=vocabulary, arch=arch)
    loaded = load_model(folder, dtype="float32")
    assert loaded.config.is_hybrid == (arch == "qwen3_5")
    llm = LLM(loaded=loaded, kv_cache_memory="64MiB", max_num_seqs=8)
    cases = _cases(llm.tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    for attempt in range(2):
        outputs = llm.generate([ids for _, ids, _ in cases], greedy)
        for (name, _, reply), out in zip(cases, outputs, strict=True):
            assert (out.text, out.finish_reason) == (reply, "stop"), (name, attempt)
    question = "Which files are in this folder?"
    num_tokens = len(llm.tokenizer.encode(question))
    assert num_tokens < len(question) / 3  # Qwen3's merges, where the bytes vocabulary has one token a byte
    llm.engine.check_integrity()
