"""Every `auto` setting resolved in one place: the model options' dtype and weight format, `EngineConfig`'s
switches and `ServerConfig`'s prompt layout, each from the config and facts about the device and the model.

Torch-free and pure, so the loader, the engine, the server, the cluster router and the planner all call it: a
caller gathers the facts (is triton installed, can the CPU's C decode step run this model, does the CPU have
AMX tiles) and gets a value back; `EngineSettings` is the frozen snapshot of what an engine runs with, logged at
start, returned by `GET /v1/engine` and found in `LLMEngine.stats()["settings"]`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

from swarmkv.choices import (
    AsyncSchedulingMode,
    AttentionBackendName,
    CascadeMode,
    JumpForwardMode,
    KVCacheDtype,
    PrefillBf16Mode,
    PrefillInt8Mode,
    PromptLayout,
    SpeculationMode,
    SpeculativeMethod,
    WeightsOption,
)
from swarmkv.errors import ConfigError
from swarmkv.units import parse_size

Backend = Literal["torch", "triton"]
WeightFormat = Literal["float", "int8", "int4", "gguf"]  # as models/quantized.py names the layers' formats
Layout = Literal["template", "tools-first"]  # a resolved PromptLayout
Api = Literal["chat", "messages", "responses"]
Checkpoint = Literal["safetensors", "gguf-float", "gguf-quantized"]  # what `weights="auto"` looks at
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")  # float64: parity tests (config.DTYPES)
# Cascade groups under `auto` where a step spares this many prefix-token reads: the torch backend's break-even
# (decodes gather their keys layer by layer); triton's decode already splits and merges, so a group costs only
# its prefix tiles and pays from a few pages saved (not yet measured on a GPU; bench/gpu.py compares).
TORCH_MIN_SAVED_TOKENS = 3072
TRITON_MIN_SAVED_TOKENS = 256
# `max_speculative_rows=auto`: past this many rows a step is compute-bound and drafts would slow it.
CPU_SPECULATIVE_ROWS, GPU_SPECULATIVE_ROWS = 8, 64
CPU_PARTIAL_PREFILLS = 2  # `max_num_partial_prefills=auto` on the CPU (docs/benchmarks.md); no limit on a GPU
# `offload_memory=auto` off the CPU: this share of the host memory available at start, at most this many KV
# pools (the tier holds paused agents' tails, and pinning host pages takes time at start).
HOST_TIER_SHARE = 0.25
HOST_TIER_MAX_POOLS = 4

log = logging.getLogger(__name__)


def model_dtype(name: str, device_type: str) -> str:
    """The compute dtype `name` means on a `device_type` device: auto is float32 on the CPU, bfloat16 elsewhere."""
    if name == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPE_NAMES)}")
    return name


def weight_format(option: WeightsOption, checkpoint: Checkpoint) -> WeightFormat:
    """The layers' format `option` means for a checkpoint: auto keeps a quantized GGUF's every tensor at its
    own bits (gguf) and loads float files (safetensors, an all-float GGUF) as float."""
    if option == "auto":
        return "gguf" if checkpoint == "gguf-quantized" else "float"
    return option


def planned_weight_format(option: str, own: str) -> str:
    """The planner's weight format: auto is the checkpoint's own (`own`), as the loader keeps it."""
    return own if option == "auto" else option


def kv_cache_dtype(option: KVCacheDtype, model_dtype_name: str, c_step_reads_half_kv: bool = False) -> str:
    """The dtype KV pages hold: auto is the model's, or float16 under a float32 model where the CPU's C decode
    step will run and reads float16 pages (as llama.cpp keeps KV: half the bytes each decode step reads)."""
    if option != "auto":
        return option
    return "float16" if c_step_reads_half_kv and model_dtype_name == "float32" else model_dtype_name


def attention_backend(
    option: AttentionBackendName, device_type: str, has_triton: bool, triton_interpreted: bool
) -> Backend:
    """The kernels a step runs: auto is triton on a CUDA or ROCm device (torch calls both "cuda") where triton
    is installed, torch elsewhere; ConfigError if triton was asked for and cannot run here."""
    if option == "auto":
        if device_type == "cuda" and not has_triton:
            log.warning("triton is not installed: attention runs on the slower torch backend")
        return "triton" if device_type == "cuda" and has_triton else "torch"
    if option == "triton":
        if not has_triton:
            raise ConfigError("attention_backend='triton' needs the triton package (pip install triton)")
        if device_type != "cuda" and not triton_interpreted:
            raise ConfigError(
                f"attention_backend='triton' runs on a CUDA or ROCm device, not {device_type!r} "
                "(on the CPU only under Triton's interpreter, TRITON_INTERPRET=1, which is for tests)"
            )
    return option


def cascade_min_saved_tokens(mode: CascadeMode, backend: Backend, configured: int | None) -> int | None:
    """The prefix-token reads a cascade group must spare in a step: None when cascade is off, 1 when on, and
    under auto `configured` or the backend's break-even."""
    if mode == "off":
        return None
    if mode == "on":
        return 1
    return configured or (TRITON_MIN_SAVED_TOKENS if backend == "triton" else TORCH_MIN_SAVED_TOKENS)


def cuda_graphs(device_type: str, backend: Backend, enforce_eager: bool) -> bool:
    """Whether decode steps replay from CUDA graphs: on a GPU's triton backend unless `enforce_eager`."""
    return device_type == "cuda" and backend == "triton" and not enforce_eager


def async_scheduling(mode: AsyncSchedulingMode, device_type: str) -> bool:
    """Whether steps are scheduled one ahead: auto on a GPU, off on the CPU where nothing overlaps."""
    return device_type != "cpu" if mode == "auto" else mode == "on"


def speculation(mode: SpeculationMode) -> bool:
    """Whether drafts are verified: auto is on (verification is exact everywhere)."""
    return mode != "off"


def mtp_drafts(mode: SpeculationMode, method: SpeculativeMethod) -> bool:
    """Whether the model's MTP layer is held to draft (where the checkpoint has one): `speculative_method` mtp
    or both, with speculation on. auto drafts from text only: the layer costs its weights and a KV slab."""
    return speculation(mode) and method in ("mtp", "both")


def text_drafts(method: SpeculativeMethod) -> bool:
    """Whether the text drafter proposes drafts (auto, text and both)."""
    return method != "mtp"


def speculative_rows(option: int | Literal["auto"], device_type: str) -> int:
    """A step's decode rows plus draft tokens at most: auto is 8 on the CPU and 64 on a GPU."""
    if option == "auto":
        return CPU_SPECULATIVE_ROWS if device_type == "cpu" else GPU_SPECULATIVE_ROWS
    return option


def partial_prefills(option: int | Literal["auto"] | None, device_type: str) -> int | None:
    """Requests one step may prefill (None: no limit): auto is 2 on the CPU, no limit on a GPU."""
    if option == "auto":
        return CPU_PARTIAL_PREFILLS if device_type == "cpu" else None
    return option or None


def jump_forward(mode: JumpForwardMode, device_type: str) -> bool:
    """Whether a grammar's forced tokens are appended at once: auto off the CPU (there a chunk of several tokens
    costs a pass of the torch modules beside the C decode step)."""
    return mode == "on" or (mode == "auto" and device_type != "cpu")


def cpu_prefill_bf16(
    mode: PrefillBf16Mode, device_type: str, hybrid: bool, decodes_read_int8: bool, amx_tiles: bool
) -> bool:
    """Whether a CPU step's prefill chunks run under bfloat16 autocast (dense models): auto where the C decode
    step already reads int8 activations and the CPU has AMX tiles."""
    if device_type != "cpu" or hybrid:
        return False
    return mode == "on" or (mode == "auto" and decodes_read_int8 and amx_tiles)


def cpu_prefill_int8(
    mode: PrefillInt8Mode, device_type: str, decodes_read_int8: bool, has_int8_gemm: bool
) -> bool:
    """Whether a CPU step's prefill chunks multiply K-quant weights on int8 activations (`EngineConfig.
    cpu_prefill_int8`): auto where the C decode step already reads int8 activations; never without the int8
    GEMM's vector build (AVX2) or off the CPU."""
    if device_type != "cpu" or not has_int8_gemm:
        return False
    return mode == "on" or (mode == "auto" and decodes_read_int8)


def offload_memory(option: int | str, device_type: str, kv_pool_bytes: int, host_available_bytes: int) -> int:
    """The host tier's bytes: auto is none on the CPU (host and device memory are the same memory there) and,
    on a GPU, a quarter of the host memory available at start, at most four KV pools; a size as it says."""
    if option != "auto":
        return parse_size(option)
    if device_type == "cpu":
        return 0
    return min(int(HOST_TIER_SHARE * host_available_bytes), HOST_TIER_MAX_POOLS * kv_pool_bytes)


def prompt_layout(setting: PromptLayout, api: Api) -> Layout:
    """The layout a request on `api` gets under `--prompt-layout setting`: auto is tools-first on every API
    (Anthropic's cache order: agents whose system texts differ still share their tools), which leaves a
    request without tools or without a system text as its template renders it."""
    if setting == "auto":
        return "tools-first"
    return setting


@dataclass(frozen=True)
class PromptLayouts:
    """`--prompt-layout` resolved for each API a request may come in on."""

    chat: Layout
    messages: Layout
    responses: Layout

    @classmethod
    def of(cls, setting: PromptLayout) -> PromptLayouts:
        """Each API's layout under `setting`."""
        return cls(*(prompt_layout(setting, api) for api in ("chat", "messages", "responses")))

    def for_api(self, api: Api) -> Layout:
        """The layout of a request on `api`."""
        layout: Layout = getattr(self, api)
        return layout


@dataclass(frozen=True)
class EngineSettings:
    """What one engine runs with, every `auto` resolved: the typed snapshot logs, `/v1/engine` and `stats()`
    read."""

    device: str
    dtype: str  # the model's compute dtype
    weights: WeightFormat
    kv_cache_dtype: str  # what the pages hold
    kv_bytes_per_token: int  # of the pages, at `kv_cache_dtype`
    attention_backend: Backend
    cascade_attention: bool
    cascade_min_saved_tokens: int | None  # None while cascade is off
    cuda_graphs: bool
    async_scheduling: bool
    speculation: bool
    max_speculative_rows: int
    max_num_partial_prefills: int | None  # None: no limit
    jump_forward: bool
    fused_cpu_decode: bool  # whether decode-only steps run the CPU's C step
    cpu_prefill_bf16: bool
    cpu_prefill_int8: bool = False  # whether prefill chunks multiply K-quant blocks on int8 activations
    mtp_drafts: bool = False  # whether the model's MTP layer drafts (`speculative_method` mtp or both)
    offload_memory: int = 0  # the host tier's bytes (`offload_memory`, auto resolved; 0: no host tier)

    def to_dict(self) -> dict[str, Any]:
        """As JSON shows it."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the start-up log."""
        return ", ".join(f"{key}={value}" for key, value in self.to_dict().items())
