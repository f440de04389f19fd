"""The int8 GEMM of prefill chunks over K-quant blocks (`kernels/cpu/gemm_int8.c`, `cpu_grouped.gemm_int8`):
within int8 rounding of a float64 reference, exactly the integer sums of its own rounding, each row independent of
its neighbours, the same in the vector and plain-C builds, and, through `GGUFLinear.prefill_int8`, a prefill whose
logits and greedy reply stay those of the float path on a tiny Q4_K_M Qwen3.5."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swarmkv import LLM, SamplingParams, resolve
from swarmkv.kernels import cpu_grouped
from swarmkv.models import gguf_linear
from swarmkv.models.gguf_linear import GGUFLinear
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import GroupedQuant, parse_blocks
from tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_grouped.available(), reason="no C compiler for the CPU kernels")
X86 = platform.machine() == "x86_64"
BUILDS = {  # this machine's, and the AVX2 and plain-C builds other CPUs get (x86 only)
    "native": None,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "plain": ("-mno-avx", "-mno-f16c"),
}
KINDS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _weight(kind: Q, rows: int, cols: int, seed: int = 0) -> GroupedQuant:
    generator = torch.Generator().manual_seed(seed)
    return parse_blocks(
        quantize(torch.randn(rows, cols, generator=generator) * 0.05, kind), kind, (rows, cols)
    )


def _x(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 30.0  # an outlier channel, as a residual stream has
    x[2 % rows, 256:] = 0.0  # a row whose later super-groups are all zero (dx = 0)
    return x


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes per super-group of 256 as the kernel rounds them (float64), and each super-group's dx."""
    groups = x.reshape(x.shape[0], -1, 256)
    dx = groups.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    codes = torch.round(groups * inv)  # half to even, as the kernel's conversion
    return codes.reshape(x.shape).double(), dx.squeeze(-1).double()


def _library(build: str) -> ctypes.CDLL:
    flags = BUILDS[build]
    if flags is not None and not X86:
        pytest.skip("an x86 build")
    library = cpu_grouped.library() if flags is None else cpu_grouped.build(flags)
    assert library is not None
    return library


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_gemm_is_its_rounding_exactly_and_within_int8_of_float64(build: str, kind: Q) -> None:
    library = _library(build)
    weight, x = _weight(kind, 40, 512), _x(13, 512)
    assert cpu_grouped.gemm_int8_reads(weight, library)
    y = cpu_grouped.gemm_int8(x, weight, library=library).double()
    w = weight.dequantize().double()
    codes, dx = _rounded(x)
    # The integer sums are exact: only float32 scaling and adds (a few ulps of the terms' sizes) remain.
    own = (codes * dx.repeat_interleave(256, dim=1)) @ w.t()
    size = (codes.abs() * dx.repeat_interleave(256, dim=1)) @ w.abs().t()
    assert ((y - own).abs() <= 1e-5 * size + 1e-6).all()
    # Rounding moves each x by at most dx / 2: the result is within that of the float64 product.
    reference = x.double() @ w.t()
    bound = (dx.repeat_interleave(256, dim=1) / 2) @ w.abs().t()
    assert ((y - reference).abs() <= bound * 1.0001 + 1e-5 * size + 1e-6).all()
    assert (y - reference).abs().max() > 0  # the bound is met by an approximation, not by the exact product


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_row_is_the_same_alone_or_among_any_neighbours(kind: Q) -> None:
    weight, x = _weight(kind, 37, 768), _x(11, 768)  # odd counts: every edge of the tiles
    batch = cpu_grouped.gemm_int8(x, weight)
    for m in range(x.shape[0]):
        assert torch.equal(cpu_grouped.gemm_int8(x[m : m + 1].contiguous(), weight)[0], batch[m])
    shuffled = torch.flip(x, dims=[0]).contiguous()
    assert torch.equal(cpu_grouped.gemm_int8(shuffled, weight), torch.flip(batch, dims=[0]))
    wider = torch.cat([torch.randn(3, 768), x]).contiguous()
    assert torch.equal(cpu_grouped.gemm_int8(wider, weight)[3:], batch)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_vector_build_sums_as_the_plain_c_one(kind: Q) -> None:
    if not X86:
        pytest.skip("an x86 build")
    plain, avx2 = cpu_grouped.build(BUILDS["plain"]), cpu_grouped.build(BUILDS["avx2"])
    assert plain is not None and avx2 is not None
    assert not cpu_grouped.has_int8_gemm(plain) and cpu_grouped.has_int8_gemm(avx2)
    weight, x = _weight(kind, 24, 512), _x(9, 512)
    a, b = cpu_grouped.gemm_int8(x, weight, library=plain), cpu_grouped.gemm_int8(x, weight, library=avx2)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_avx512_vnni_build_compiles() -> None:
    if not X86:
        pytest.skip("an x86 build")
    assert cpu_grouped.build(("-march=sapphirerapids",)) is not None  # built and loaded, never run here


def test_other_layouts_are_refused() -> None:
    for kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        weight = _weight(kind, 8, 512)
        assert not cpu_grouped.gemm_int8_reads(weight)
        with pytest.raises(AssertionError):
            cpu_grouped.gemm_int8(_x(9, 512), weight)


def _layer(blocks: list[GroupedQuant | torch.Tensor]) -> GGUFLinear:
    rows = sum(int(b.shape[0]) for b in blocks)
    layer = GGUFLinear(512, rows, bias=False)
    start = 0
    for block in blocks:
        layer.load_block(start, block)
        start += int(block.shape[0])
    layer.finalize()
    return layer


def test_the_layer_reads_k_quants_on_int8_only_past_the_gemv_and_only_when_asked() -> None:
    q4k, q6k, q8 = _weight(Q.Q4_K, 16, 512), _weight(Q.Q6_K, 24, 512, seed=2), _weight(Q.Q8_0, 8, 512, seed=3)
    layer = _layer([q4k, q8, q6k])
    x = _x(20, 512)
    float_path = layer(x)
    assert gguf_linear.use_prefill_int8(layer, True) == 1
    int8_path = layer(x)
    assert torch.equal(int8_path[:, 16:24], float_path[:, 16:24])  # Q8_0 stays float32
    assert torch.equal(int8_path[:, :16], cpu_grouped.gemm_int8(x, q4k))
    assert torch.equal(int8_path[:, 24:], cpu_grouped.gemm_int8(x, q6k))
    few = layer(x[:4])  # a decode-sized batch: the GEMV, whatever the setting
    gguf_linear.use_prefill_int8(layer, False)
    assert torch.equal(layer(x[:4]), few)
    assert torch.equal(layer(x), float_path)  # off: the exact float path again


def test_auto_follows_the_decode_steps_rounding_on_the_cpu() -> None:
    assert resolve.cpu_prefill_int8("auto", "cpu", decodes_read_int8=True, has_int8_gemm=True)
    assert not resolve.cpu_prefill_int8("auto", "cpu", decodes_read_int8=False, has_int8_gemm=True)
    assert resolve.cpu_prefill_int8("on", "cpu", decodes_read_int8=False, has_int8_gemm=True)
    assert not resolve.cpu_prefill_int8("on", "cpu", decodes_read_int8=True, has_int8_gemm=False)
    assert not resolve.cpu_prefill_int8("on", "cuda", decodes_read_int8=True, has_int8_gemm=True)
    assert not resolve.cpu_prefill_int8("off", "cpu", decodes_read_int8=True, has_int8_gemm=True)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("int8-gemm")
    mix = dict(projections=Q.Q4_K, embedding=Q.Q6_K, types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K})
    return write_tiny_gguf(folder / "q4_k_m.gguf", "qwen35", **mix)  # type: ignore[arg-type]


def _prefill_logits_and_reply(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The logits of the prompt's prefill step and the greedy reply."""
    seen: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def spy(plan: Any, *provisional: Any) -> Any:
        chunks, logits = run(plan, *provisional)
        seen.append(logits.clone())
        return chunks, logits

    llm.engine.runner.run = spy
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.engine.runner.run = run
    assert out.error is None and out.finish_reason == "length" and len(out.token_ids) == 6
    return seen[0][0], out.token_ids


def test_a_prefill_on_int8_keeps_the_float_paths_answer(q4_k_m: Path) -> None:
    llm = LLM(str(q4_k_m), dtype="float32", speculation="off", prefix_caching=False)
    model = llm.engine.runner.model
    prompt = [(37 * i + 11) % 900 + 50 for i in range(96)]
    gguf_linear.use_prefill_int8(model, False)
    reference, _ = _prefill_logits_and_reply(llm, prompt)
    assert gguf_linear.use_prefill_int8(model, True) > 0
    rounded, reply = _prefill_logits_and_reply(llm, prompt)
    assert not torch.equal(rounded, reference)  # the int8 path ran
    assert float((rounded - reference).abs().max() / reference.abs().max()) < 0.15  # as the int8 decode
    assert reply[0] in reference.topk(5).indices.tolist()  # the answer is one the float path ranks high


def test_the_engine_resolves_the_setting_and_shows_it(q4_k_m: Path) -> None:
    def held_int8(llm: LLM) -> set[bool]:
        return {m.prefill_int8 for m in llm.engine.runner.model.modules() if isinstance(m, GGUFLinear)}

    auto = LLM(str(q4_k_m), dtype="float32", speculation="off", max_num_seqs=2)
    decode = auto.engine.runner.cpu_decode
    expected = cpu_grouped.has_int8_gemm() and decode is not None and decode.reads_int8
    assert auto.engine.settings.cpu_prefill_int8 is expected
    assert held_int8(auto) == {expected}
    off = LLM(str(q4_k_m), dtype="float32", speculation="off", max_num_seqs=2, cpu_prefill_int8="off")
    assert off.engine.settings.cpu_prefill_int8 is False and held_int8(off) == {False}
