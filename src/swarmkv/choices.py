"""The names an engine or model option may take, torch-free, so configs and the modules that act on them share one list."""

from __future__ import annotations

from typing import Literal

AttentionBackendName = Literal["auto", "torch", "triton"]
ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = ("auto", "torch", "triton")

CascadeMode = Literal["auto", "on", "off"]
CASCADE_MODES: tuple[CascadeMode, ...] = ("auto", "on", "off")
JumpForwardMode = Literal["auto", "on", "off"]
JUMP_FORWARD_MODES: tuple[JumpForwardMode, ...] = ("auto", "on", "off")
SpeculationMode = Literal["auto", "on", "off"]
SPECULATION_MODES: tuple[SpeculationMode, ...] = ("auto", "on", "off")
# Where a draft may come from (spec/drafter.py): the request's own context, its siblings' replies under the same
# head, its session's earlier turns.
DraftSource = Literal["own", "sibling", "session"]
DRAFT_SOURCES: tuple[DraftSource, ...] = ("own", "sibling", "session")
DraftOrigin = Literal["own", "sibling", "session", "mtp"]  # a draft's source: a text, or the MTP layer
# What drafts come from (`EngineConfig.speculative_method`): the texts above, a model's MTP layer, or both
# (a chooser takes the better draft each step); auto: the text drafter.
SpeculativeMethod = Literal["auto", "text", "mtp", "both"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = ("auto", "text", "mtp", "both")
AsyncSchedulingMode = Literal["auto", "on", "off"]
ASYNC_SCHEDULING_MODES: tuple[AsyncSchedulingMode, ...] = ("auto", "on", "off")
PrefillBf16Mode = Literal["auto", "on", "off"]
PREFILL_BF16_MODES: tuple[PrefillBf16Mode, ...] = ("auto", "on", "off")
PrefillInt8Mode = Literal["auto", "on", "off"]
PREFILL_INT8_MODES: tuple[PrefillInt8Mode, ...] = ("auto", "on", "off")
# The CPU decode step's second int8 pass: groups a row (EngineConfig.cpu_int8_residual_groups has its figures).
CPU_INT8_RESIDUAL_GROUPS = 3
MAX_CPU_INT8_RESIDUAL_GROUPS = 4  # kernels/cpu/grouped.c's MAX_RESIDUAL_GROUPS
LoopGuardMode = Literal["constrained", "all", "off"]
LOOP_GUARD_MODES: tuple[LoopGuardMode, ...] = ("constrained", "all", "off")

KVCacheDtype = Literal["auto", "float16", "bfloat16", "float32", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("auto", "float16", "bfloat16", "float32", "fp8_e4m3")

WeightsOption = Literal["auto", "float", "int8", "int4", "gguf"]
WEIGHTS_OPTIONS: tuple[WeightsOption, ...] = ("auto", "float", "int8", "int4", "gguf")

# A max_tokens above what the context leaves after the prompt: clamped to that room, or a 400.
MaxTokensPolicy = Literal["clamp", "refuse"]
# Which tool calls follow a grammar: every call (always), or only strict tools' and forced calls (strict).
ToolCallGrammar = Literal["always", "strict"]

# A /v1/responses tool the provider runs (web_search, file_search, ...): left out of the prompt, or a 400.
HostedToolsPolicy = Literal["drop", "refuse"]

PromptLayout = Literal["auto", "template", "tools-first"]
PROMPT_LAYOUTS: tuple[PromptLayout, ...] = ("auto", "template", "tools-first")
