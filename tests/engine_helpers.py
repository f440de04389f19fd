"""Tiny random models for engine tests: float64 so that greedy choices never hinge on rounding noise."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from conftest_tokenizer_helpers import qwen_tokenizer
from swarmkv import LLM, SamplingParams
from swarmkv.config import ModelConfig
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.loader import LoadedModel

TINY_VOCAB = 384  # byte-level ids of the Qwen tokenizer: every one decodes, none is an end-of-turn token
# The tiny models' head counts for interpreted engine tests. The interpreter walks one program per token and
# head (norm and rotary, attention) or per state slot and value head (the delta rule, the conv), so halving
# the heads halves its work, while each ratio the kernels index by stays as the tiny shape has it: two q
# heads on each KV head (GQA) and two value heads on each key head (Qwen3.5's linear attention).
FEWER_HEADS: dict[str, object] = {"num_attention_heads": 2, "num_key_value_heads": 1}
FEWER_HYBRID_HEADS: dict[str, object] = {
    **FEWER_HEADS,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
}


def tiny_config(**overrides: object) -> ModelConfig:
    """A 2-layer GQA Llama shape small enough to run thousands of steps in a test."""
    fields: dict[str, object] = {
        "architecture": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": TINY_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    return ModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]


@cache
def tiny_loaded(seed: int = 0, max_positions: int = 4096) -> LoadedModel:
    """A 2-layer GQA Llama with random weights on the CPU in float64."""
    config = tiny_config(max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    model = DecoderForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper logits: distinct argmax, varied continuations
    model.rotary.build(torch.device("cpu"))
    return LoadedModel(
        Path("tiny"), "tiny", config, model.eval(), qwen_tokenizer(), torch.float64, torch.device("cpu")
    )


def tiny_llm(**kwargs: object) -> LLM:
    """An LLM over the tiny model; kwargs go to LLM (pool size, block size, budgets, caching)."""
    kwargs.setdefault("kv_cache_memory", 64 * 2**20)
    return LLM(loaded=tiny_loaded(), **kwargs)  # type: ignore[arg-type]


def checked_generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, **kw: object
) -> list[list[int]]:
    """Each prompt's reply, the engine's books checked after every step (kw: add_request's salt, session)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{engine.core.num_arrivals}-{i}", prompt, params, **kw)  # type: ignore[arg-type]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.check_integrity()
    return [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("-", 1)[1]))]
