"""`offload_memory=auto`: no host tier on the CPU, a share of host memory on a GPU, the resolved size shown."""

from __future__ import annotations

import argparse

import pytest

import swarmkv.resolve as resolve
from engine_helpers import tiny_llm
from swarmkv.core.config import EngineConfig
from swarmkv.options import add_engine_arguments, engine_kwargs
from swarmkv.units import GIB

MIB = 2**20


def test_auto_is_none_on_the_cpu_whatever_the_host_has() -> None:
    assert resolve.offload_memory("auto", "cpu", GIB, 512 * GIB) == 0


def test_auto_on_a_gpu_is_a_share_of_available_host_memory_at_most_four_pools() -> None:
    assert resolve.offload_memory("auto", "cuda", GIB, 8 * GIB) == 2 * GIB  # a quarter of 8 GiB
    assert resolve.offload_memory("auto", "cuda", GIB, 128 * GIB) == 4 * GIB  # four 1 GiB pools
    assert resolve.offload_memory("auto", "cuda", 2 * GIB, 0) == 0  # nothing available, nothing taken


def test_a_size_means_what_it_says_on_every_device() -> None:
    for device in ("cpu", "cuda"):
        assert resolve.offload_memory("1GiB", device, GIB, 512 * GIB) == GIB
        assert resolve.offload_memory(0, device, GIB, 512 * GIB) == 0
        assert resolve.offload_memory(3 * MIB, device, GIB, 0) == 3 * MIB


def test_the_config_takes_auto_by_default_and_refuses_what_is_no_size() -> None:
    config = EngineConfig()
    assert config.offload_memory == "auto"
    assert config.offload_bytes("cpu", 64 * GIB) == 0
    assert config.offload_bytes("cuda", 64 * GIB) == 4 * config.kv_cache_bytes
    with pytest.raises(ValueError, match="cannot read size"):
        EngineConfig(offload_memory="lots")
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(offload_memory=-1)


def test_the_flag_takes_auto_and_sizes() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args([]))["offload_memory"] == "auto"
    assert engine_kwargs(parser.parse_args(["--offload-memory", "auto"]))["offload_memory"] == "auto"
    assert engine_kwargs(parser.parse_args(["--offload-memory", "2GiB"]))["offload_memory"] == 2 * GIB
    with pytest.raises(SystemExit):
        parser.parse_args(["--offload-memory", "plenty"])


def test_the_engine_shows_the_resolved_host_tier() -> None:
    auto = tiny_llm(kv_cache_memory=MIB).engine
    assert auto.settings.offload_memory == 0  # the tiny model runs on the CPU
    assert auto.core.kv.host.num_pages == 0
    assert auto.stats()["settings"]["offload_memory"] == 0
    sized = tiny_llm(kv_cache_memory=MIB, offload_memory=MIB).engine
    pages = sized.core.kv.host.num_pages
    assert pages > 0
    assert sized.settings.offload_memory == pages * sized.page_bytes <= MIB
    assert f"offload_memory={pages * sized.page_bytes}" in sized.settings.describe()
