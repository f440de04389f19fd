"""Every `auto` resolved once (swarmkv/resolve.py): nothing left `auto`, and what it became shown in stats() and
over HTTP (`GET /v1/engine`)."""

from __future__ import annotations

import dataclasses

import httpx

from engine_helpers import tiny_llm
from swarmkv import resolve
from swarmkv.core.config import EngineConfig
from swarmkv.resolve import EngineSettings, PromptLayouts
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer


def _no_auto(settings: EngineSettings) -> None:
    for field in dataclasses.fields(settings):
        assert getattr(settings, field.name) != "auto", field.name


def test_every_auto_of_the_default_config_is_resolved() -> None:
    llm = tiny_llm()
    settings = llm.engine.settings
    _no_auto(settings)
    assert settings.device == "cpu" and settings.attention_backend == "torch"
    assert settings.async_scheduling is False and settings.cuda_graphs is False
    assert settings.max_num_partial_prefills == EngineConfig().partial_prefill_limit("cpu") == 2
    assert settings.speculation and settings.max_speculative_rows == 8
    assert settings.cascade_attention and settings.cascade_min_saved_tokens == resolve.TORCH_MIN_SAVED_TOKENS
    assert settings.kv_bytes_per_token == llm.engine.kv_bytes_per_token
    assert llm.stats()["settings"] == settings.to_dict()


def test_off_modes_resolve_to_off() -> None:
    settings = tiny_llm(cascade_attention="off", speculation="off", jump_forward="off").engine.settings
    _no_auto(settings)
    assert not settings.cascade_attention and settings.cascade_min_saved_tokens is None
    assert not settings.speculation and settings.max_speculative_rows == 0 and not settings.jump_forward


def test_the_decisions_by_device() -> None:
    assert (
        resolve.model_dtype("auto", "cpu") == "float32" and resolve.model_dtype("auto", "cuda") == "bfloat16"
    )
    assert resolve.weight_format("auto", "gguf-quantized") == "gguf"
    assert (
        resolve.weight_format("auto", "safetensors") == resolve.weight_format("auto", "gguf-float") == "float"
    )
    assert resolve.kv_cache_dtype("auto", "float32", c_step_reads_half_kv=True) == "float16"
    assert resolve.kv_cache_dtype("auto", "bfloat16", c_step_reads_half_kv=True) == "bfloat16"
    assert resolve.kv_cache_dtype("fp8_e4m3", "float32") == "fp8_e4m3"
    assert resolve.attention_backend("auto", "cuda", has_triton=True, triton_interpreted=False) == "triton"
    assert resolve.cuda_graphs("cuda", "triton", enforce_eager=False)
    assert resolve.async_scheduling("auto", "cuda") and not resolve.async_scheduling("auto", "cpu")
    assert resolve.partial_prefills("auto", "cuda") is None and resolve.speculative_rows("auto", "cuda") == 64
    assert resolve.cascade_min_saved_tokens("auto", "triton", None) == resolve.TRITON_MIN_SAVED_TOKENS
    assert resolve.cpu_prefill_bf16("auto", "cpu", False, decodes_read_int8=True, amx_tiles=True)
    assert not resolve.cpu_prefill_bf16("on", "cpu", True, decodes_read_int8=True, amx_tiles=True)
    assert PromptLayouts.of("auto") == PromptLayouts("tools-first", "tools-first", "tools-first")


def test_the_engine_route_shows_the_resolved_settings() -> None:
    llm = tiny_llm()
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.get("/v1/engine").json()
    assert "auto" not in body.values()
    assert body["prompt_layout"] == {
        "chat": "tools-first",
        "messages": "tools-first",
        "responses": "tools-first",
    }
    assert {k: v for k, v in body.items() if k != "prompt_layout"} == llm.engine.settings.to_dict()
