"""The Triton matmul over GGUF blocks at their own bits (kernels/grouped_matmul.py, on quant_gemv's kernel), under
Triton's CPU interpreter: every type of the grouped layout against its exact float dequantisation, at decode and prefill
sizes, with and without a K split; and GGUF-held layers on it against the CPU path."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from swarmkv.models.attention import CausalSelfAttention
from swarmkv.models.gguf_linear import GGUFLinear
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import SPECS, GroupedQuant, int8_groups, parse_blocks
from swarmkv.models.loader import load_model
from tiny_gguf import write_tiny_gguf

triton = pytest.importorskip("triton")
from swarmkv.kernels import grouped_matmul as gm  # noqa: E402
from swarmkv.kernels.quant_gemv import GemvPlan, plan_quant_gemv  # noqa: E402

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


def held(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> GroupedQuant:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02
    return parse_blocks(quantize(weight, kind), kind, (rows, cols))


def reference(x: torch.Tensor, weight: GroupedQuant) -> torch.Tensor:
    return (x.double() @ weight.dequantize().double().t()).float()


@pytest.mark.parametrize("kind", list(SPECS), ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 20, 40])  # vector units (1, 2), tl.dot decode tiles, prefill
def test_every_type_matches_its_dequantisation(kind: GGMLQuantizationType, rows: int) -> None:
    weight = held(kind, 40, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gm.grouped_matmul(x, weight), reference(x, weight), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_the_int8_weight_format_matches_its_dequantisation(rows: int) -> None:
    """The weight format int8 (8-bit codes with a minimum, no GGUF type of its own) through the same kernel, at
    576 columns (a masked last tile) and with a K split."""
    weight = int8_groups(torch.randn(40, 576, generator=torch.Generator().manual_seed(5)) * 0.02 + 0.01)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    for units in (1, 132):
        got = gm.grouped_matmul(x, weight, units=units)
        torch.testing.assert_close(got, reference(x, weight), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda k: k.name)
def test_a_k_split_sums_the_same(kind: GGMLQuantizationType) -> None:
    """Many compute units and few row tiles: K splits into float32 partial sums, added in a fixed order."""
    weight = held(kind, 24, 2048)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(2))
    assert gm.plan_grouped(3, weight, units=132).splits > 1
    split = gm.grouped_matmul(x, weight, units=132)
    torch.testing.assert_close(split, reference(x, weight), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(split, gm.grouped_matmul(x, weight, units=1), atol=1e-6, rtol=1e-5)
    assert torch.equal(split, gm.grouped_matmul(x, weight, units=132))  # the same order every time


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q5_1, Q.Q8_0], ids=lambda k: k.name)
def test_k_past_the_last_whole_tile(kind: GGMLQuantizationType) -> None:
    """K = 576 (the embedded SmolLM2's hidden size) is 4.5 tiles of 128: the last one is masked."""
    weight = held(kind, 33, 576)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(gm.grouped_matmul(x, weight), reference(x, weight), atol=1e-5, rtol=1e-4)


def test_into_a_column_slice_and_in_half_precision() -> None:
    weight = held(Q.Q4_K, 32, 512)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    out = torch.zeros(4, 96)
    gm.grouped_matmul(x, weight, out=out[:, 40:72])
    torch.testing.assert_close(out[:, 40:72], reference(x, weight), atol=1e-5, rtol=1e-4)
    assert not out[:, :40].any() and not out[:, 72:].any()
    half = gm.grouped_matmul(x.half(), weight)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), reference(x.half().float(), weight), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K], ids=lambda k: k.name)
def test_decode_tiles_read_each_weight_once_and_prefill_reuses_it(kind: GGMLQuantizationType) -> None:
    spec = SPECS[kind]

    def plan(rows: int, units: int) -> GemvPlan:  # grouped_matmul's launch for a 4096 x 4096 weight, fp16 x
        return plan_quant_gemv(rows, 4096, 4096, spec.bits, spec.group_size, units, x_bytes=2)

    for rows in (1, 8):
        decode = plan(rows, units=64)
        assert decode.block_m >= rows  # one M tile covers every row
        assert decode.chunk_bytes >= 8  # code bytes a lane loads at once
        assert decode.use_dot == (rows > 2)
    assert plan(1, units=1).splits == 1  # 128 row tiles fill one unit
    assert plan(512, units=132).block_m == 64


def test_a_partial_high_word_and_tile() -> None:
    """5-bit codes at K = 96 (one partial K step) and N = 40 (a partial row tile): high words past K are masked."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    for kind in (Q.Q5_0, Q.Q5_1):
        weight = held(kind, 40, 96)
        for rows in (1, 3):
            out = gm.grouped_matmul(x[:rows], weight)
            torch.testing.assert_close(out, reference(x[:rows], weight), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_K_M-like: Q6_K rows beside Q4_K ones in one fused QKV, an untied Q8_0 head, a float projection.
    folder = tmp_path_factory.mktemp("grouped")
    return write_tiny_gguf(
        folder / "mix.gguf",
        "qwen3",
        projections=Q.Q4_K,
        types={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_K, "attn_output": Q.F16},
        tied=False,
    )


def test_gguf_layers_on_the_triton_kernel_match_the_cpu_path(mixed_gguf: Path) -> None:
    """The whole model's logits with every GGUF-held projection on the Triton kernel (as on a GPU) against the
    C / torch path of the CPU, float32."""
    loaded = load_model(str(mixed_gguf), dtype="float32", weights="gguf")
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert any(len(m.blocks) > 1 for m in layers)  # the fused QKV holds Q4_K and Q6_K row blocks
    ids = torch.tensor([3, 17, 99, 5, 250, 8, 41])
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        cpu = model.compute_logits(model(ids, positions, CausalSelfAttention()))
        for layer in layers:
            layer.kernel = "triton"
        on_triton = model.compute_logits(model(ids, positions, CausalSelfAttention()))
    torch.testing.assert_close(on_triton, cpu, atol=2e-4, rtol=1e-3)
    assert torch.equal(on_triton.argmax(-1), cpu.argmax(-1))


def test_gguf_weights_are_refused_where_no_kernel_reads_them(
    mixed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device with neither the C kernel nor triton (a GPU without triton, or another kind): a ConfigError
    naming the formats that run, before any weight is read."""
    from swarmkv.errors import ConfigError
    from swarmkv.models import gguf_linear

    assert gguf_linear.gguf_kernels_run_on(torch.device("cpu"))
    assert not gguf_linear.gguf_kernels_run_on(torch.device("meta"))
    monkeypatch.setattr(gguf_linear, "gguf_kernels_run_on", lambda device: False)
    with pytest.raises(ConfigError, match="elsewhere use --weights float"):
        load_model(str(mixed_gguf), dtype="float32", weights="gguf")
