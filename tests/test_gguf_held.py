"""GGUF files held at their own bits (weight format "gguf"): every tensor's blocks kept exactly, embedding and
LM head included; the CPU kernel against the dequantised weights; logits against the dequantised model."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from swarmkv.errors import ConfigError, ModelLoadError
from swarmkv.kernels import cpu_grouped
from swarmkv.models import gguf_linear
from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear, gguf_modules
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import SPECS, held_bytes, parse_blocks
from swarmkv.models.gguf_weights import unpermute_rotary_rows
from swarmkv.models.loader import LoadedModel, load_model
from test_models import swarmkv_logits
from tiny_gguf import SHAPE, rewrite_gguf, write_tiny_gguf

Q = GGMLQuantizationType
KINDS = list(SPECS)
IDS = [5, 17, 300, 1000, 12, 9, 77, 900, 2, 31, 640, 8]
ARCHS = ["llama", "qwen3", "qwen35"]


def model_bytes(loaded: LoadedModel) -> int:
    """Bytes of every parameter and held block (the tie shares one copy; the rotary tables not counted)."""
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    rotary = {id(t) for t in loaded.model.rotary.buffers()}
    return sum(t.numel() * t.element_size() for t in tensors if id(t) not in rotary)


def file_dequantized(path: Path, name: str) -> torch.Tensor:
    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-held")
    out = {
        f"{arch}-{kind.name}" if arch != "llama" else kind.name: write_tiny_gguf(
            folder / f"{arch}-{kind.name}.gguf", arch, projections=kind
        )
        for arch in ARCHS
        for kind in KINDS
    }
    # A Q4_K_M-like mix on Qwen3, untied, its embedding Q4_K and its head Q6_K.
    out["mix"] = write_tiny_gguf(
        folder / "mix.gguf",
        "qwen3",
        projections=Q.Q4_K,
        embedding=Q.Q4_K,
        types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output.weight": Q.Q6_K},
        tied=False,
    )
    out["qwen35-mix"] = write_tiny_gguf(
        folder / "qwen35-mix.gguf",
        "qwen35",
        projections=Q.Q4_K,
        embedding=Q.Q4_K,
        types={"attn_v": Q.Q6_K, "attn_qkv": Q.Q6_K, "ffn_down": Q.Q6_K, "output.weight": Q.Q6_K},
        tied=False,
    )
    return out


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_type_is_held_exactly_at_its_bytes(files: dict[str, Path], kind: GGMLQuantizationType) -> None:
    loaded = load_model(files[kind.name], dtype="float32")
    assert loaded.weights == "gguf"
    model = loaded.model
    # Projections: the fused rows dequantise bit for bit to gguf's dequantisation of each file tensor.
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and len(qkv.blocks) == 1  # q, k and v stacked: one kernel call
    expected = torch.cat(
        [
            unpermute_rotary_rows(file_dequantized(files[kind.name], "blk.1.attn_q.weight"), SHAPE["heads"]),
            unpermute_rotary_rows(
                file_dequantized(files[kind.name], "blk.1.attn_k.weight"), SHAPE["kv_heads"]
            ),
            file_dequantized(files[kind.name], "blk.1.attn_v.weight"),
        ]
    )
    assert torch.equal(qkv.dequantize(), expected)
    down = model.layers[0].mlp.down_proj
    assert torch.equal(down.dequantize(), file_dequantized(files[kind.name], "blk.0.ffn_down.weight"))
    # The embedding is the file's Q8_0 blocks, and the tied LM head reads the same tensors.
    embedding = model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert [b.weight for b in model.lm_head.blocks] == [b.weight for b in embedding.blocks]
    ids = torch.tensor(IDS)
    assert torch.equal(embedding(ids), file_dequantized(files[kind.name], "token_embd.weight")[ids])
    # Bytes: the model holds exactly what the layout's formula says, and the report agrees.
    report = loaded.weight_report
    assert report is not None
    formula = sum(
        held_bytes(GGMLQuantizationType(t.tensor_type), *reversed([int(d) for d in t.shape.tolist()]))
        if t.tensor_type in SPECS
        else int(t.n_elements) * 4
        for t in GGUFReader(files[kind.name]).tensors
    )
    assert model_bytes(loaded) == report.held_bytes == formula
    assert report.types[kind.name].held_as == kind.name


NAMES = [f"{arch}-{k.name}" if arch != "llama" else k.name for arch in ARCHS for k in KINDS] + [
    "mix",
    "qwen35-mix",
]


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_the_dequantised_model(
    files: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GEMV (decode-sized batches; here the LM head's rows) sums in its own order: within 1e-4 of the logits'
    scale (measured: 4e-6). With the dequantised tile everywhere the logits are bit for bit the reference's."""
    held = load_model(files[name], dtype="float32")
    reference = load_model(files[name], dtype="float32", weights="float")
    assert held.weights == "gguf" and reference.weights == "float"
    expected = swarmkv_logits(reference, IDS)
    scale = max(1.0, expected.abs().max().item())
    assert (swarmkv_logits(held, IDS) - expected).abs().max().item() <= 1e-4 * scale
    hidden = torch.randn(3, SHAPE["hidden"])
    assert torch.allclose(
        held.model.compute_logits(hidden), reference.model.compute_logits(hidden), atol=1e-4 * scale
    )
    monkeypatch.setattr(gguf_linear, "GEMV_MAX_ROWS", 0)
    assert torch.equal(swarmkv_logits(held, IDS), expected)


def test_a_q4_k_m_like_mix_keeps_each_shard_at_its_type(files: dict[str, Path]) -> None:
    loaded = load_model(files["mix"], dtype="float32")
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert [b.weight.bits for b in qkv.blocks] == [4, 6]  # q and k stacked as Q4_K, v as Q6_K
    assert isinstance(loaded.model.lm_head, GGUFLinear) and loaded.model.lm_head.blocks[0].weight.bits == 6
    report = loaded.weight_report
    assert report is not None and set(report.types) == {"F32", "Q4_K", "Q6_K"}
    assert model_bytes(loaded) == report.held_bytes
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(files["mix"]).tensors)
    assert report.file_bytes == file_bytes and report.held_bytes <= 1.03 * file_bytes


# This machine's build, and the AVX2 and plain-C ones other CPUs get (x86 only for AVX2).
ARCH_FLAGS = {
    "native": None,
    "avx2": ("-mavx2", "-mfma", "-mf16c") if platform.machine() == "x86_64" else None,
    "plain": ("-mno-avx", "-mno-f16c") if platform.machine() == "x86_64" else (),
}


@pytest.mark.parametrize("arch", list(ARCH_FLAGS))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_the_cpu_kernel_matches_the_dequantised_matmul(
    kind: GGMLQuantizationType, rows: int, arch: str
) -> None:
    if not cpu_grouped.available():
        pytest.skip("no C compiler on this machine: the torch path is tested below")
    flags = ARCH_FLAGS[arch]
    if arch != "native" and flags is None:
        pytest.skip(f"{arch} is an x86 build")
    library = None if flags is None else cpu_grouped.build(flags)
    torch.manual_seed(rows)
    weight = parse_blocks(quantize(torch.randn(40, 512) * 0.05, kind), kind, (40, 512))
    x = torch.randn(rows, 512)
    expected = x @ weight.dequantize().t()
    wide = torch.full((rows, 50), float("nan"))
    cpu_grouped.matmul(x, weight, wide[:, 5:45], library)  # a column slice of a wider output
    assert torch.allclose(wide[:, 5:45], expected, atol=1e-5, rtol=1e-5)
    assert wide[:, :5].isnan().all() and wide[:, 45:].isnan().all()
    index = torch.tensor([39, 0, 7, 7])
    assert torch.equal(cpu_grouped.dequantize_rows(weight, index, library), weight.dequantize()[index])


def int8_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of 32 rounded to a multiple of its max |x| / 127, and that step [rows, groups, 1]."""
    step = groups.abs().amax(-1, keepdim=True) / 127
    return torch.where(step > 0, torch.round(groups / step), 0) * step, step


def int8_activations(x: torch.Tensor, residual_groups: int = 0) -> torch.Tensor:
    """x as the int8 path sees it: each group of 32 rounded to a multiple of max |x| / 127; the
    `residual_groups` groups of a row with the largest step (the earlier first among equals, none of step 0)
    also add what that rounding left, rounded the same way."""
    groups = x.view(x.shape[0], -1, 32)
    first, step = int8_groups(groups)
    order = torch.sort(step[..., 0], dim=1, descending=True, stable=True).indices[:, :residual_groups]
    chosen = torch.zeros_like(step[..., 0], dtype=torch.bool).scatter_(1, order, True) & (step[..., 0] > 0)
    second, _ = int8_groups(groups - first)
    return (first + second * chosen[..., None]).view_as(x)


INT8_KINDS = [
    k
    for k in KINDS
    if (SPECS[k].group_size == 32 and SPECS[k].bits in (4, 5, 8)) or k == GGMLQuantizationType.Q6_K
]


@pytest.mark.parametrize("arch", list(ARCH_FLAGS))
@pytest.mark.parametrize("kind", INT8_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize(
    "cols", [512, 96]
)  # 96: an odd number of groups (the 512-bit path takes two at once)
def test_the_int8_activation_kernel_is_exact_on_the_rounded_input(
    kind: GGMLQuantizationType, rows: int, cols: int, arch: str
) -> None:
    if not cpu_grouped.available():
        pytest.skip("no C compiler on this machine")
    flags = ARCH_FLAGS[arch]
    if arch != "native" and flags is None:
        pytest.skip(f"{arch} is an x86 build")
    if SPECS[kind].super_group and cols % SPECS[kind].super_group:
        pytest.skip("K-quant rows come in super-groups of 256")
    library = None if flags is None else cpu_grouped.build(flags)
    torch.manual_seed(rows + cols)
    weight = parse_blocks(quantize(torch.randn(40, cols) * 0.05, kind), kind, (40, cols))
    if not cpu_grouped.reads_int8(weight, library):
        assert arch == "plain" or platform.machine() != "x86_64", "every x86 build from AVX2 on has it"
        return
    x = torch.randn(rows, cols)
    x[0, :32] = 0.0  # an all-zero group has scale 0
    got = cpu_grouped.matmul_int8(x, weight, library)
    # The integer dot products are exact; only the float scaling and sums differ in order.
    expected = int8_activations(x) @ weight.dequantize().t()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert (got - x @ weight.dequantize().t()).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("kind", INT8_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 8, 9])
@pytest.mark.parametrize("cols", [512, 96, 64])  # 64: fewer groups than the pass asks for
def test_the_residual_pass_adds_a_second_int8_pass_over_each_rows_largest_groups(
    kind: GGMLQuantizationType, rows: int, cols: int
) -> None:
    if not cpu_grouped.available() or not cpu_grouped.has_int8_dot():
        pytest.skip("no int8 kernel on this machine")
    if SPECS[kind].super_group and cols % SPECS[kind].super_group:
        pytest.skip("K-quant rows come in super-groups of 256")
    torch.manual_seed(rows * cols)
    weight = parse_blocks(quantize(torch.randn(40, cols) * 0.05, kind), kind, (40, cols))
    x = torch.randn(rows, cols)
    x[:, 37] *= 40.0  # an outlier channel: its group's step is coarse for the other 31
    x[0, 64:96] = 0.0  # a group of step 0 is never chosen
    exact = x @ weight.dequantize().t()
    plain = cpu_grouped.matmul_int8(x, weight)
    got = cpu_grouped.matmul_int8(x, weight, residual_groups=3)
    if not cpu_grouped.reads_residual(weight):
        assert torch.equal(got, plain)  # kernels without the pass ignore it
        return
    expected = int8_activations(x, residual_groups=3) @ weight.dequantize().t()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert (got - exact).abs().max() < 0.5 * (plain - exact).abs().max()


def test_without_the_c_kernel_the_torch_path_gives_the_same(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with_kernel = load_model(files["mix"], dtype="float32")
    logits = swarmkv_logits(with_kernel, IDS)
    monkeypatch.setattr(gguf_linear.cpu_grouped, "available", lambda: False)
    torch_only = load_model(files["mix"], dtype="float32")
    assert torch.allclose(swarmkv_logits(torch_only, IDS), logits, atol=1e-4)


def test_a_type_the_layout_does_not_hold_is_converted_with_its_error_reported(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q3.gguf", projections=Q.Q4_0)
    # One projection as Q3_K blocks: random bytes with a sane float16 super-scale.
    block, size = GGML_QUANT_SIZES[Q.Q3_K]
    rows, cols = SHAPE["intermediate"], SHAPE["hidden"]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    raw[..., -2:] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    out = rewrite_gguf(
        path, tmp_path / "converted.gguf", {"blk.0.ffn_up.weight": (raw.reshape(rows, -1), Q.Q3_K)}
    )
    loaded = load_model(out, dtype="float32")
    report = loaded.weight_report
    assert report is not None
    entry = report.types["Q3_K"]
    assert entry.held_as == "Q8_0" and entry.tensors == 1
    exact = file_dequantized(out, "blk.0.ffn_up.weight")
    held = loaded.model.layers[0].mlp.gate_up_proj.dequantize()[SHAPE["intermediate"] :]
    measured = (held - exact).abs().max().item()
    assert 0 < entry.max_abs_error == pytest.approx(measured)
    assert entry.max_relative_error == pytest.approx(measured / exact.abs().max().item())
    assert entry.max_relative_error < 0.01  # Q8_0: about half a step of 1/127 of a group's largest


def test_the_embedded_model_is_held_at_its_file_bytes() -> None:
    loaded = load_model(None, dtype="float32")
    report = loaded.weight_report
    assert loaded.weights == "gguf" and report is not None
    assert report.types["Q8_0"].held_as == "Q8_0"  # the tied embedding and LM head: 30 MB, not 113 MB float
    assert report.held_bytes == report.file_bytes == model_bytes(loaded)


def test_gguf_blocks_on_a_gpu_are_refused_with_the_formats_that_run(files: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="with triton installed.*use --weights float"):
        load_model(files["Q4_K"], device="meta", weights="gguf")


def test_modules_are_found_by_their_weight_names(files: dict[str, Path]) -> None:
    names = set(gguf_modules(load_model(files["Q4_0"], dtype="float32").model))
    assert {"embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.qkv_proj.weight"} <= names


@pytest.mark.parametrize("name", ["mix", "qwen35-mix", "qwen3-Q5_1", "embedded"])
def test_the_planner_counts_the_bytes_the_loader_holds(files: dict[str, Path], name: str) -> None:
    """`swarmkv plan`'s per-tensor count (from the tensor infos only) equals the loaded model's bytes, at both
    float dtypes the floats may be held in."""
    from swarmkv.models.default import default_model_path
    from swarmkv.models.gguf_file import open_gguf
    from swarmkv.plan.gguf_count import count_gguf_weights

    path = default_model_path() if name == "embedded" else files[name]
    file = open_gguf(path)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(path, dtype=dtype)
        planned = count_gguf_weights(file.reader, file.metadata, dtype)
        assert planned.total_bytes == model_bytes(loaded)
        assert loaded.weight_report is not None and loaded.weight_report.held_bytes == planned.total_bytes


def test_stats_show_the_weights_held_per_type(files: dict[str, Path]) -> None:
    from swarmkv import LLM

    llm = LLM(loaded=load_model(files["mix"], dtype="float32"), kv_cache_memory="16MiB")
    weights = llm.stats()["weights"]
    assert weights["held_bytes"] == model_bytes(llm.loaded)
    assert set(weights["types"]) == {"F32", "Q4_K", "Q6_K"}
    assert weights["types"]["Q6_K"]["held_as"] == "Q6_K"


def test_gguf_weights_for_a_safetensors_checkpoint_are_refused(tmp_path: Path) -> None:
    from tiny_models import make_tiny_checkpoint

    with pytest.raises(ConfigError, match="safetensors"):
        load_model(make_tiny_checkpoint(tmp_path), weights="gguf")


def test_a_quantized_tensor_bound_for_a_float_parameter_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "norm.gguf", projections=Q.Q4_0)
    norm = quantize(torch.ones(1, SHAPE["hidden"]), Q.Q8_0)  # a norm's weight as Q8_0 blocks
    out = rewrite_gguf(path, tmp_path / "bad.gguf", {"blk.0.attn_norm.weight": (norm, Q.Q8_0)})
    with pytest.raises(ModelLoadError, match=r"input_layernorm.*only float"):
        load_model(out, dtype="float32")


def test_a_kernel_that_cannot_be_built_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("SWARMKV_CACHE_DIR", str(tmp_path))
    assert cpu_grouped.build(("-DSWARMKV_TEST_BUILD_FAILS",)) is None
    assert not list(tmp_path.rglob("*.so"))


def test_the_kernels_build_wherever_a_c_compiler_is_found() -> None:
    """The C tests skip without a compiler; with one, a source that does not compile must fail here, not skip."""
    if os.environ.get("SWARMKV_CPU_KERNELS", "").lower() == "torch":
        pytest.skip("the torch path is forced")
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine")
    assert cpu_grouped.available()
