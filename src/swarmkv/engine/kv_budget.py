"""How an engine's KV memory splits: the pages' dtype and bytes, a hybrid's recurrent-state slots out of the
same budget, the pages left, the host tier's pages, and the context length, each refused with a
CapacityError a user can act on; and the tensors so sized."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.engine import cpu_decode
from swarmkv.engine.host_kv import HostKV
from swarmkv.engine.kv_cache import FP8, KVCache, kv_storage_dtype
from swarmkv.engine.kv_calibration import calibrate_kv_scales
from swarmkv.engine.state_cache import StateCache
from swarmkv.errors import CapacityError
from swarmkv.models.loader import LoadedModel


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as settings name it ("float32", "fp8_e4m3")."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


def kv_page_dtype(loaded: LoadedModel, config: EngineConfig) -> str:
    """The dtype `config`'s pages hold for `loaded` (`swarmkv.resolve.kv_cache_dtype`): whether the CPU's C
    decode step will run and read float16 pages is the fact it takes from here."""
    half_kv = config.fused_cpu_decode and (
        cpu_decode.auto_kv_dtype(loaded.model, loaded.dtype, loaded.device) is not None
    )
    return resolve.kv_cache_dtype(config.kv_cache_dtype, dtype_name(loaded.dtype), half_kv)


def host_available_bytes() -> int:
    """Host memory available to new allocations now (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class KVBudget:
    """The KV pool's shape for one model and config."""

    kv_dtype: torch.dtype
    kv_bytes_per_token: int
    page_bytes: int
    num_pages: int
    state_bytes_per_sequence: int  # a hybrid's recurrent state; 0 for a plain transformer
    num_state_slots: int
    num_host_pages: int
    max_model_len: int

    @classmethod
    def of(cls, loaded: LoadedModel, config: EngineConfig) -> KVBudget:
        """The split of `config`'s memory for `loaded`; CapacityError if it cannot hold one request."""
        kv_dtype = kv_storage_dtype(kv_page_dtype(loaded, config))
        kv_bytes_per_token = loaded.config.kv_bytes_per_token(kv_dtype)
        page_bytes = kv_bytes_per_token * config.block_size
        # A hybrid's recurrent states (running and snapshots) come out of the same budget as the pages.
        state_bytes = loaded.config.state_bytes_per_sequence(loaded.dtype)
        num_state_slots = config.state_bytes // state_bytes if state_bytes else 0
        if state_bytes and num_state_slots < 2:
            raise CapacityError(
                f"state_memory of {config.state_bytes} bytes holds {num_state_slots} recurrent state(s) of "
                f"{state_bytes} bytes; a hybrid model needs at least 2 (one running, one "
                f"snapshot): raise kv_cache_memory or state_memory"
            )
        num_pages = (config.kv_cache_bytes - num_state_slots * state_bytes) // page_bytes
        model_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise CapacityError(
                f"max_model_len={config.max_model_len} exceeds the model's context of {model_len} positions"
            )
        if num_pages < 2:
            # One page for the prompt and one to decode into is the least any request needs.
            raise CapacityError(
                f"a KV pool of {config.kv_cache_bytes} bytes holds {num_pages} page(s) of {page_bytes} bytes; "
                f"it cannot hold a single request: raise kv_cache_memory"
            )
        return cls(
            kv_dtype,
            kv_bytes_per_token,
            page_bytes,
            num_pages,
            state_bytes,
            num_state_slots,
            config.offload_bytes(loaded.device.type, host_available_bytes()) // page_bytes
            if config.prefix_caching
            else 0,
            config.max_model_len if config.max_model_len is not None else model_len,
        )

    def tensors(
        self, loaded: LoadedModel, page_size: int
    ) -> tuple[KVCache, HostKV | None, StateCache | None]:
        """The pages (fp8 ones calibrated), the host tier's copy of them (None: none) and a hybrid's state
        slots (None for a plain transformer), on the model's device."""
        config, dtype, device = loaded.config, loaded.dtype, loaded.device
        kv = KVCache(config, self.num_pages, page_size, dtype, device, self.kv_dtype)
        if kv.is_fp8:
            calibrate_kv_scales(loaded.model, kv, loaded.tokenizer)
        host = HostKV(kv, self.num_host_pages) if self.num_host_pages else None
        states = StateCache(config, self.num_state_slots, dtype, device) if self.num_state_slots else None
        assert states is None or states.bytes_per_slot == self.state_bytes_per_sequence
        return kv, host, states
