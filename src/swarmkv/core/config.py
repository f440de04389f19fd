"""The one source of engine defaults: `LLM`'s keyword arguments and every command's flags derive from here.

Each field carries its help text; `swarmkv.options` turns fields into argparse flags, so a default written
here is the default everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import swarmkv.resolve as resolve
from swarmkv.choices import (
    ASYNC_SCHEDULING_MODES,
    ATTENTION_BACKENDS,
    CASCADE_MODES,
    CPU_INT8_RESIDUAL_GROUPS,
    DRAFT_SOURCES,
    JUMP_FORWARD_MODES,
    KV_CACHE_DTYPES,
    LOOP_GUARD_MODES,
    MAX_CPU_INT8_RESIDUAL_GROUPS,
    PREFILL_BF16_MODES,
    PREFILL_INT8_MODES,
    SPECULATION_MODES,
    SPECULATIVE_METHODS,
    AsyncSchedulingMode,
    AttentionBackendName,
    CascadeMode,
    DraftSource,
    JumpForwardMode,
    KVCacheDtype,
    LoopGuardMode,
    PrefillBf16Mode,
    PrefillInt8Mode,
    SpeculationMode,
    SpeculativeMethod,
    WeightsOption,
)
from swarmkv.kv.retention import RETENTION_POLICIES, RetentionPolicy
from swarmkv.units import parse_size


def _opt(default: Any, help: str, flag: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class ModelOptions:
    """Which checkpoint to load, in what dtype, on which device."""

    model: str | None = _opt(None, "HF directory or GGUF file (default: the embedded SmolLM2-135M)")
    dtype: str = _opt("auto", "auto, float32, bfloat16 or float16")
    device: str = _opt("cpu", "torch device, e.g. cpu, cuda, cuda:1")
    weights: WeightsOption = _opt(
        "auto",
        "weights: auto (a quantized GGUF keeps every tensor at its own bits, gguf, on the CPU and on a GPU; "
        "other checkpoints stay float), float, int8, int4 or gguf",
    )


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and switches of one engine; `max_model_len` None means the model's own context."""

    kv_cache_memory: int | str = _opt("1GiB", "KV pool size, e.g. 512MiB, 2GiB")
    block_size: int = _opt(16, "tokens per KV page")
    kv_cache_dtype: KVCacheDtype = _opt(
        "auto",
        "KV page dtype: auto (the model's; float16 under a float32 model the CPU's C decode step runs, as "
        "llama.cpp keeps KV), float16, bfloat16, float32 or fp8_e4m3 (a scale per layer)",
    )
    prefix_caching: bool = _opt(True, "share KV pages of identical prefixes between requests")
    retention: RetentionPolicy = _opt(
        "session",
        "which cached pages go first under pressure: session (released sessions, superseded branches,"
        " then LRU, paused agents' tails, the shared head last), return (released and superseded first, then"
        " what paused agents reach, the furthest expected return first, from each tool's observed pauses;"
        " the shared head weighed by its sessions) or lru",
    )
    offload_memory: int | str = _opt(
        "auto",
        "host memory that evicted KV pages move to instead of being dropped, e.g. 8GiB (0: none); auto: none "
        "on the CPU, where host and device memory are one, and on a GPU a quarter of the host memory available "
        "at start, at most four KV pools",
    )
    max_pinned_memory: int | str | None = _opt(
        None, "cap on KV bytes that pins may hold, e.g. 256MiB (default: half the KV pool)"
    )
    state_memory: int | str | None = _opt(
        None,
        "hybrid models (Qwen3.5): the part of kv_cache_memory for recurrent states, each running request's "
        "and the prefix snapshots, e.g. 1GiB (default: half of it)",
    )
    max_num_seqs: int = _opt(64, "requests running at once")
    max_num_batched_tokens: int = _opt(2048, "tokens computed per step (prefill chunks plus decodes)")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    cascade_attention: CascadeMode = _opt(
        "auto", "decodes read a shared prefix once: auto (where it pays), on, or off"
    )
    attention_backend: AttentionBackendName = _opt(
        "auto", "attention kernels: auto (triton on CUDA/ROCm, torch elsewhere), torch or triton"
    )
    enforce_eager: bool = _opt(False, "never replay decode steps from CUDA graphs")
    mixed_step_graphs: bool = _opt(
        False,
        "also replay steps with prefill chunks from graphs (dense models; at most 256 prefill tokens in 4 "
        "chunks), one per bucket of decodes and of prefill tokens; off until a GPU measurement shows they pay",
    )
    fused_cpu_decode: bool = _opt(
        True,
        "on the CPU, run each decode-only step of a dense model held at its GGUF bits as one C call "
        "(kernels/cpu/decode.c) instead of through the torch modules",
    )
    cpu_prefill_bf16: PrefillBf16Mode = _opt(
        "auto",
        "on the CPU, run steps' prefill chunks through the torch modules in bfloat16 (torch.autocast: the "
        "matmuls and attention; the LM head stays float32), dense models only: faster on AMX, and about as close "
        "to float32 as the int8-activation decode step (figures in docs/benchmarks.md). auto: on where decodes "
        "already run that C step on int8 activations (a model held at its GGUF bits) and the CPU has AMX tiles; "
        "off for float checkpoints",
    )
    cpu_prefill_int8: PrefillInt8Mode = _opt(
        "auto",
        "on the CPU, multiply prefill chunks' projections held at Q4_K, Q5_K or Q6_K bits on int8 activations "
        "(quantised per 256 as llama.cpp's Q8_K) with the integer dot products, instead of dequantising the "
        "weights for a float32 matmul (exact to the file's float values); other types stay float32. auto: on "
        "where the C decode step already reads int8 activations (cpu_int8_activations, a model held at its GGUF "
        "bits) and the CPU has AVX2",
    )
    cpu_int8_activations: bool = _opt(
        True,
        "in that C decode step, quantise each projection's input to int8 per group of 32 (as llama.cpp does) "
        "and multiply on the CPU's integer dot products; off: float32 activations (slower, closer to float)",
    )
    cpu_int8_residual_groups: int = _opt(
        CPU_INT8_RESIDUAL_GROUPS,
        "with int8 activations, the groups of 32 in each row of a layer's input that get a second int8 pass "
        "over what the first left (those of largest scale, where one outlier coarsens the step for the other "
        "31): 0 to 4, 0 for llama.cpp's single pass. Read by the 16-row kernel (Q4_0, Q4_1, Q8_0 on AVX-512 "
        "VNNI). More groups bring the step's tokens closer to float's and make each step a little longer, "
        "most at larger batches (figures in docs/benchmarks.md)",
    )
    jump_forward: JumpForwardMode = _opt(
        "auto",
        "constrained replies: on appends the tokens a grammar forces (keys, punctuation) all at once, computed "
        "in the next step as one chunk; off appends one a step in place of a sampled one; auto: on off the "
        "CPU (there a chunk of several tokens costs a pass of the torch modules beside the C decode step)",
    )
    loop_guard: LoopGuardMode = _opt(
        "constrained",
        "steer a reply out of a verbatim loop (a string repeating itself until max_tokens cuts it): once "
        "its last 32+ tokens repeat a period 3+ times, the token continuing the loop gets DRY's growing "
        "penalty. constrained: replies under a grammar, which a cut would leave unparsable; all; off",
    )
    close_at_length: bool = _opt(
        True,
        "a constrained reply whose tokens left to max_tokens come down to the shortest ending its grammar "
        "allows gets that ending forced, so a reply cut by its length still parses (finish_reason stays length)",
    )
    speculation: SpeculationMode = _opt(
        "auto",
        "speculative decoding without a draft model: drafts from suffix automata over each request's own "
        "context, its siblings' replies under the same head and its session's earlier turns, verified "
        "exactly several tokens a pass (a hybrid's recurrent state rewound to the last accepted "
        "position, on either backend). Under a grammar a draft stops before any token that forces a run, and "
        "its rows are masked along it; under the loop guard it stops short of any row the guard would "
        "penalise. auto: on; on; off",
    )
    async_scheduling: AsyncSchedulingMode = _opt(
        "auto",
        "one step of lookahead: the next step is scheduled and its inputs prepared while the device runs "
        "this one, whose sampled ids come back with an asynchronous copy and feed the next step on the "
        "device (vLLM's async scheduling). A step whose tokens the next step's schedule must see (drafts, "
        "grammars, the loop guard) is waited for first. auto: on a GPU; off on the CPU, where the step is "
        "synchronous and nothing overlaps",
    )
    num_speculative_tokens: int = _opt(8, "draft tokens a request may verify in one step at most")
    speculative_method: SpeculativeMethod = _opt(
        "auto",
        "where drafts come from: text (suffix automata over the request's context and its siblings' and "
        "session's replies), mtp (the model's own multi-token-prediction "
        "layer, Qwen3.5's: held at the file's bits, with a KV slab of its own, so it costs one attention layer's "
        "KV a token), or both (per request and step, the draft expected to yield more tokens per unit of step "
        "time, none when neither pays). A model without an MTP layer drafts from text. auto: text",
    )
    num_mtp_tokens: int = _opt(
        3, "tokens an MTP draft has at most (the MTP layer chained on its own output, an LM head pass each)"
    )
    draft_sources: tuple[DraftSource, ...] = _opt(
        DRAFT_SOURCES,
        "the texts drafts may come from: own (the request's prompt and reply), sibling (replies of requests "
        "under the same head and cache salt) and session (its session's earlier turns); bench/speculation.py "
        "turns sibling off to measure what siblings add",
        flag=False,
    )
    max_speculative_rows: int | Literal["auto"] = _opt(
        "auto",
        "a step's decode rows plus draft tokens at most: past it a step is compute-bound and drafts would "
        "slow it. auto: 8 on the CPU (so from 8 decodes on, none drafts) and 64 on a GPU (docs/benchmarks.md "
        "has the CPU's measurement)",
        flag=False,
    )
    max_open_sessions: int = _opt(
        4096, "open sessions kept at most; past it the one idle longest is released", flag=False
    )
    max_session_id_chars: int = _opt(256, "the longest session id a request may name", flag=False)
    starvation_steps: int = _opt(
        16, "a prefill passed over this many steps in a row goes before shorter ones", flag=False
    )
    max_waiting_considered: int = _opt(
        256,
        "waiting requests looked up per step for the shortest prefill; later ones wait their turn",
        flag=False,
    )
    max_num_partial_prefills: int | Literal["auto"] | None = _opt(
        "auto",
        "requests prefilled in one step at most, shortest first; a follower of a head another request was "
        "computing, and a prefill with at most a page left, take no place (0 or None: as many as the token "
        "budget holds). auto: 2 on the CPU, so that agents returning together get their first tokens sooner "
        "(docs/benchmarks.md has the measurement); no limit on a GPU",
    )
    cascade_min_saved_tokens: int | None = _opt(
        None,
        "cascade_attention=auto groups decodes when that spares this many prefix-token reads in a step"
        " (default: 3072 on the torch backend, 256 on triton)",
        flag=False,
    )
    swap_bytes_per_s: float | None = _opt(
        None,
        "host <-> device copy bandwidth that swap-or-recompute assumes (default: 12e9 on a GPU, 4e9 on the CPU)",
        flag=False,
    )
    prefill_s_per_token: float | None = _opt(
        None,
        "starting guess of prefill seconds per token, refined from timed steps (default: 1e-4 on a GPU,"
        " 3e-3 on the CPU)",
        flag=False,
    )
    seed: int = _opt(0, "seed of requests that sample without their own seed", flag=False)
    check_writes: bool = _opt(False, "assert before each step that it writes only private pages", flag=False)

    def __post_init__(self) -> None:
        if self.jump_forward not in JUMP_FORWARD_MODES:
            raise ValueError(f"jump_forward must be one of {JUMP_FORWARD_MODES}, got {self.jump_forward!r}")
        if self.cascade_attention not in CASCADE_MODES:
            raise ValueError(
                f"cascade_attention must be one of {CASCADE_MODES}, got {self.cascade_attention!r}"
            )
        if self.loop_guard not in LOOP_GUARD_MODES:
            raise ValueError(f"loop_guard must be one of {LOOP_GUARD_MODES}, got {self.loop_guard!r}")
        if self.async_scheduling not in ASYNC_SCHEDULING_MODES:
            raise ValueError(
                f"async_scheduling must be one of {ASYNC_SCHEDULING_MODES}, got {self.async_scheduling!r}"
            )
        if self.cpu_prefill_bf16 not in PREFILL_BF16_MODES:
            raise ValueError(
                f"cpu_prefill_bf16 must be one of {PREFILL_BF16_MODES}, got {self.cpu_prefill_bf16!r}"
            )
        if self.cpu_prefill_int8 not in PREFILL_INT8_MODES:
            raise ValueError(
                f"cpu_prefill_int8 must be one of {PREFILL_INT8_MODES}, got {self.cpu_prefill_int8!r}"
            )
        groups = self.cpu_int8_residual_groups
        if (
            isinstance(groups, bool)
            or not isinstance(groups, int)
            or not 0 <= groups <= MAX_CPU_INT8_RESIDUAL_GROUPS
        ):
            raise ValueError(
                f"cpu_int8_residual_groups must be an integer from 0 to {MAX_CPU_INT8_RESIDUAL_GROUPS}, got {groups!r}"
            )
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}"
            )
        if (
            isinstance(self.num_mtp_tokens, bool)
            or not isinstance(self.num_mtp_tokens, int)
            or not (1 <= self.num_mtp_tokens <= 8)
        ):
            raise ValueError(f"num_mtp_tokens must be an integer from 1 to 8, got {self.num_mtp_tokens!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        sources = self.draft_sources
        if not isinstance(sources, tuple) or not set(sources) <= set(DRAFT_SOURCES):
            raise ValueError(f"draft_sources must be a tuple of {DRAFT_SOURCES}, got {sources!r}")
        rows = self.max_speculative_rows
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ValueError(f"max_speculative_rows must be auto or an integer >= 0, got {rows!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.retention not in RETENTION_POLICIES:
            raise ValueError(f"retention must be one of {RETENTION_POLICIES}, got {self.retention!r}")
        if self.offload_memory != "auto":
            parse_size(self.offload_memory)  # a size, or ValueError naming what it could not read
        if self.max_pinned_bytes < 0:
            raise ValueError("max_pinned_memory cannot be negative")
        if self.state_memory is not None and not 0 < self.state_bytes < self.kv_cache_bytes:
            raise ValueError(
                "state_memory must be positive and less than kv_cache_memory: KV needs pages too"
            )
        if self.max_pinned_bytes >= self.kv_cache_bytes:
            raise ValueError("max_pinned_memory must be less than kv_cache_memory: requests need pages too")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_open_sessions",
            "max_session_id_chars",
            "starvation_steps",
            "max_waiting_considered",
            "num_speculative_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        partial = self.max_num_partial_prefills
        if partial not in ("auto", None) and (
            isinstance(partial, bool) or not isinstance(partial, int) or partial < 0
        ):
            raise ValueError(
                f"max_num_partial_prefills must be auto, 0 (no limit) or a positive integer, got {partial!r}"
            )
        for name in ("cascade_min_saved_tokens", "swap_bytes_per_s", "prefill_s_per_token"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    def partial_prefill_limit(self, device_type: str) -> int | None:
        """Requests one step may prefill on a `device_type` ("cpu", "cuda") device (`swarmkv.resolve`); None:
        no limit."""
        return resolve.partial_prefills(self.max_num_partial_prefills, device_type)

    def lookahead(self, device_type: str) -> bool:
        """Whether steps on a `device_type` device are scheduled one ahead (`swarmkv.resolve`)."""
        return resolve.async_scheduling(self.async_scheduling, device_type)

    def speculative_rows(self, device_type: str) -> int:
        """A step's decode rows plus draft tokens at most on a `device_type` device (`swarmkv.resolve`)."""
        return resolve.speculative_rows(self.max_speculative_rows, device_type)

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size in bytes."""
        return parse_size(self.kv_cache_memory)

    def offload_bytes(self, device_type: str, host_available_bytes: int) -> int:
        """The host tier's size in bytes on a `device_type` device (0: no host tier; `swarmkv.resolve`)."""
        return resolve.offload_memory(
            self.offload_memory, device_type, self.kv_cache_bytes, host_available_bytes
        )

    @property
    def state_bytes(self) -> int:
        """The recurrent-state budget of a hybrid model, taken from the KV pool's: by default half of it. A
        hybrid's attention layers are a quarter of its layers, so its pages are cheap and its states are not:
        eight agents hold eight running states and a snapshot at each turn's end and at the shared head's."""
        if self.state_memory is None:
            return self.kv_cache_bytes // 2
        return parse_size(self.state_memory)

    @property
    def max_pinned_bytes(self) -> int:
        """The most KV bytes pins may hold."""
        if self.max_pinned_memory is None:
            return self.kv_cache_bytes // 2
        return parse_size(self.max_pinned_memory)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, refusing unknown names with a TypeError that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)
