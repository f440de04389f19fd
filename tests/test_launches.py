"""Device operations per decoder layer in one decode-only step of the triton backend (interpreted on the CPU),
counted by swarmkv.engine.launch_count: issue 27's target is at most 9 per Qwen3 layer with cascade off,
counting GEMMs, split-K reductions and attention's merge."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from swarmkv.core.sampling_params import SamplingParams  # noqa: E402
from swarmkv.engine.launch_count import count_launches, launches_per_layer  # noqa: E402
from swarmkv.engine.llm import LLM  # noqa: E402
from tiny_models import TinyArch, make_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_LAUNCHES_PER_LAYER = 9


def _decode_step_launches(folder: Path, arch: TinyArch) -> tuple[list[int], list[str]]:
    make_tiny_checkpoint(folder, arch)
    llm = LLM(
        str(folder),
        dtype="float32",
        device=DEVICE,
        attention_backend="triton",
        enforce_eager=True,
        cascade_attention="off",
        block_size=4,
        kv_cache_memory="8MiB",  # a few pages: the default 1 GiB pool is half a million pages of 4 here
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], params)
    sampled: set[str] = set()
    for _ in range(3):  # until both have sampled a token: the next step decodes only
        sampled |= {delta.request_id for delta in engine.step() if delta.new_token_ids}
        if len(sampled) == 2:
            break
    assert len(sampled) == 2
    runner = engine.runner.triton
    assert runner is not None
    per_layer, launches = launches_per_layer(runner.model, engine.step)
    return per_layer, launches.layer_names(0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_decode_step_launches_at_most_9_per_layer(tmp_path: Path, arch: TinyArch) -> None:
    per_layer, names = _decode_step_launches(tmp_path, arch)
    assert len(per_layer) == 2 and len(set(per_layer)) == 1, per_layer
    assert per_layer[0] <= MAX_LAUNCHES_PER_LAYER, names
    # Nothing copies q or k before the rotary, and the KV store rides in the rotary kernel.
    assert not any(name in ("aten::clone", "aten::copy_") for name in names), names
    assert "triton::_store_kv_kernel" not in names, names
    assert names.count("triton::_qk_norm_rotary_kernel") == 1, names
    assert names.count("triton::_attention_kernel") == 1, names  # decode only: no extend tiles


def test_the_counter_sees_reshape_copies_under_inference_mode() -> None:
    """A reshape that must copy counts once; views and allocations count nothing (the counter itself can fail)."""
    with torch.inference_mode():
        qkv = torch.randn(2, 128)
        q = qkv[:, :64]
        with count_launches() as launches:
            heads = q.reshape(2, 4, 16)  # a view
            heads.reshape(-1, 16)  # a copy: token rows are 128 apart, heads 16
            torch.empty(3)
    assert launches.names == ["aten::clone"]
    with count_launches(device=torch.device("meta")) as elsewhere:  # host ops do not count for a device
        heads.reshape(-1, 16)
        torch.ones(2, device="meta").add_(1)
    assert elsewhere.names == ["aten::ones", "aten::add_"]
