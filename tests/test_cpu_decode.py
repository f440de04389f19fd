"""The whole-step C decode (engine/cpu_decode.py over kernels/cpu/decode.c) against the torch modules on the
same engine: every decode step's logits, on tiny GGUF files of several types and architectures, alone and
batched, with shared prefixes read once per group; and where it declines to run."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from swarmkv import LLM, SamplingParams
from swarmkv.core.scheduler import StepPlan
from swarmkv.engine import cpu_decode
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.runner import ModelRunner
from swarmkv.kernels import cpu_grouped
from swarmkv.kernels.cpu_decode import reads_half_kv
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import SPECS, parse_blocks
from tiny_gguf import SHAPE, write_tiny_gguf

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_grouped.available(), reason="no C compiler for the CPU kernels")

FILES = {
    "llama-q4_1": dict(arch="llama", projections=Q.Q4_1),
    "llama-q5_0-f16": dict(arch="llama", projections=Q.Q5_0, types={"attn_output": Q.F16}),
    "qwen3-q8_0": dict(arch="qwen3", projections=Q.Q8_0),
    # Q4_K_M-like: Q6_K (groups of 16) rows beside Q4_K ones in one fused QKV; untied head.
    "qwen3-mix": dict(
        arch="qwen3",
        projections=Q.Q4_K,
        embedding=Q.Q4_K,
        types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output.weight": Q.Q6_K},
        tied=False,
    ),
}
SHARED = list(range(40, 120))  # 80 tokens: five pages of 16, two whole tiles of 32
LONG_SHARED = list(range(40, 340))  # 300 tokens: one whole attention chunk of 256, read once per group


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cpu-decode")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", **spec) for name, spec in FILES.items()}  # type: ignore[arg-type]


class Checked:
    """Wraps a runner: each decode-only step runs through C and then again through the torch modules (which
    rewrite the same K and V); the logits are compared and C's returned."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.run = runner, runner.run
        self.steps, self.worst, self.rows, self.same_top1 = 0, 0.0, 0, 0

    def __call__(self, plan: StepPlan, *provisional: Any) -> tuple[list, torch.Tensor]:  # type: ignore[type-arg]
        fused = self.runner.cpu_decode
        chunks, logits = self.run(plan, *provisional)
        if fused is not None and all(c.kind == "decode" for c in plan.chunks):
            self.runner.cpu_decode = None
            try:
                torch_chunks, reference = self.run(plan, *provisional)
            finally:
                self.runner.cpu_decode = fused
            by_id = {c.request_id: i for i, c in enumerate(torch_chunks)}
            reference = reference[[by_id[c.request_id] for c in chunks]]
            scale = float(reference.abs().max())
            self.worst = max(self.worst, float((logits - reference).abs().max()) / scale)
            self.steps += 1
            self.rows += len(chunks)
            self.same_top1 += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        return chunks, logits


def checked_llm(path: Path, **options: object) -> tuple[LLM, Checked]:
    options.setdefault(
        "speculation", "off"
    )  # the check compares decode rows; test_speculation.py covers drafts
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", **options)  # type: ignore[arg-type]
    assert llm.engine.runner.cpu_decode is not None, cpu_decode.why_not(
        llm.loaded.model, llm.engine.runner.kv_cache, llm.loaded.device
    )
    check = Checked(llm.engine.runner)
    llm.engine.runner.run = check  # type: ignore[method-assign]
    return llm, check


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", list(FILES))
def test_decode_logits_match_the_torch_modules(files: dict[str, Path], name: str) -> None:
    """Float32 activations: the same arithmetic as the modules, summed in another order."""
    llm, check = checked_llm(files[name], cascade_attention="on", cpu_int8_activations=False)
    prompts: list[list[int]] = [
        [5, 9, 300, 12],
        SHARED + [7, 8],
        SHARED + [901, 3, 4, 5, 6],
        list(range(1, 50)),
    ]
    outputs = llm.generate(prompts, GREEDY)  # type: ignore[arg-type]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)
    assert check.steps >= GREEDY.max_tokens - 1
    assert check.worst < 1e-4, f"largest logit difference {check.worst:.2e} of the largest logit"


@pytest.mark.parametrize("name", list(FILES))
def test_int8_activations_stay_close_to_the_torch_modules(files: dict[str, Path], name: str) -> None:
    """x rounded to int8 per group of 32 moves the logits by about a percent, rarely the top token."""
    llm, check = checked_llm(files[name], cascade_attention="on")
    prompts: list[list[int]] = [[5, 9, 300, 12], SHARED + [7, 8], list(range(1, 50))]
    llm.generate(prompts, GREEDY)  # type: ignore[arg-type]
    assert check.steps >= GREEDY.max_tokens - 1
    assert check.worst < 0.05, f"largest logit difference {check.worst:.2e} of the largest logit"
    assert check.same_top1 >= 0.9 * check.rows


def test_a_row_decodes_the_same_alone_grouped_and_batched(files: dict[str, Path]) -> None:
    """Tiles start at position 0 whatever the grouping, so the shared prefix read once changes nothing. Float32
    activations: the shared prefix's KV comes from prefills of other chunk sizes in the batch, whose last-bit
    differences int8 rounding of later activations could amplify into another greedy token."""
    path = files["qwen3-mix"]
    target = LONG_SHARED + [11, 12, 13]
    options: dict[str, Any] = dict(dtype="float32", kv_cache_memory="64MiB", cpu_int8_activations=False)
    alone = LLM(str(path), **options).generate([target], GREEDY)[0]
    llm = LLM(str(path), cascade_attention="on", **options)
    batch = [LONG_SHARED + [21 + i] for i in range(5)] + [target] + [[3, 4, 5, 6]]
    together = llm.generate(batch, GREEDY)  # type: ignore[arg-type]
    assert llm.engine.counters.cascade_decode_rows > 0  # the shared pages formed a group
    assert together[5].token_ids == alone.token_ids


def test_cascade_off_still_decodes_in_c(files: dict[str, Path]) -> None:
    llm, check = checked_llm(files["llama-q4_1"], cascade_attention="off", cpu_int8_activations=False)
    llm.generate([SHARED + [1], SHARED + [2]], GREEDY)  # type: ignore[list-item]
    assert llm.engine.counters.cascade_decode_rows == 0
    assert check.steps > 0 and check.worst < 1e-4


def test_it_declines_what_it_cannot_describe(files: dict[str, Path]) -> None:
    path = files["llama-q4_1"]
    cases = {
        "weights are 'int8'": LLM(str(path), dtype="float32", weights="int8", kv_cache_memory="64MiB"),
        "KV pages are neither": LLM(
            str(path), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory="64MiB"
        ),
    }
    for reason, llm in cases.items():
        runner = llm.engine.runner
        assert runner.cpu_decode is None
        assert reason in (cpu_decode.why_not(llm.loaded.model, runner.kv_cache, llm.loaded.device) or "")
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids  # the torch modules still decode
    off = LLM(str(path), dtype="float32", fused_cpu_decode=False, kv_cache_memory="64MiB")
    assert off.engine.runner.cpu_decode is None


def test_decodes_beside_a_chunked_prefill_run_in_c_and_match(files: dict[str, Path]) -> None:
    """A step with prefill chunks runs its decodes in C and the chunks through the modules."""
    path = files["qwen3-q8_0"]
    prompts: list[list[int]] = [
        [5, 6, 7, 8],
        LONG_SHARED,
    ]  # the long one prefills in chunks while the other decodes
    options = dict(
        dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64, cpu_int8_activations=False
    )
    fused = LLM(str(path), **options)  # type: ignore[arg-type]
    calls: list[int] = []
    step = fused.engine.runner.cpu_decode
    assert step is not None
    original = step.step
    mixed = 0

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    step.step = counting  # type: ignore[method-assign]
    run = fused.engine.runner.run

    def spy(plan: StepPlan, *provisional: Any) -> tuple[list, torch.Tensor]:  # type: ignore[type-arg]
        nonlocal mixed
        kinds = {c.kind for c in plan.chunks}
        mixed += kinds == {"prefill", "decode"}
        return run(plan, *provisional)

    fused.engine.runner.run = spy  # type: ignore[method-assign]
    got = [o.token_ids for o in fused.generate(prompts, GREEDY)]  # type: ignore[arg-type]
    modules = LLM(str(path), fused_cpu_decode=False, **options)  # type: ignore[arg-type]
    want = [o.token_ids for o in modules.generate(prompts, GREEDY)]  # type: ignore[arg-type]
    assert mixed > 0 and len(calls) >= mixed
    assert got == want


def test_float16_kv_pages_decode_in_c_as_the_modules_do(files: dict[str, Path]) -> None:
    """float16 pages: C converts a tile at a time to read and rounds to nearest even to write, as torch does."""
    if not reads_half_kv():
        pytest.skip("this build has no F16C")
    llm, check = checked_llm(
        files["qwen3-mix"], cascade_attention="on", cpu_int8_activations=False, kv_cache_dtype="float16"
    )
    assert llm.engine.runner.kv_cache.storage_dtype == torch.float16
    prompts: list[list[int]] = [[5, 9, 300, 12], LONG_SHARED + [7, 8], LONG_SHARED + [901, 3]]
    llm.generate(prompts, GREEDY)  # type: ignore[arg-type]
    assert check.steps >= GREEDY.max_tokens - 1
    assert check.worst < 1e-4, f"largest logit difference {check.worst:.2e} of the largest logit"


def test_a_position_past_the_rotary_table_is_refused(files: dict[str, Path]) -> None:
    """The scheduler never asks for one (max_model_len); the C step refuses rather than read past the table."""
    llm = LLM(str(files["llama-q4_1"]), dtype="float32", kv_cache_memory="64MiB")
    step = llm.engine.runner.cpu_decode
    assert step is not None
    one = torch.zeros(1, dtype=torch.int64)
    past = torch.tensor([llm.loaded.model.rotary.max_positions])
    with pytest.raises(AssertionError, match="status 3"):
        step.step(one, one, past, [1], [0])


INT8_KINDS = [k for k in SPECS if SPECS[k].group_size == 32 and SPECS[k].bits in (4, 5, 8)] + [
    GGMLQuantizationType.Q6_K
]
BUILDS = {"native": None, "avx2": ("-mavx2", "-mfma", "-mf16c")}  # the 512-bit kernel where native has it


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each group of 32 rounded to a multiple of max |x| / 127."""
    groups = x.view(x.shape[0], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.where(step > 0, torch.round(groups / step), 0) * step).view_as(x)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("kind", INT8_KINDS, ids=lambda k: k.name)
def test_the_int8_kernel_at_every_row_count(kind: GGMLQuantizationType, build: str) -> None:
    """M = 1 to 9 rows (the kernel takes up to 8 at once, with a constant count each) over K with 1, 2, 3 and 0
    groups past the last block of four (the 512-bit kernel's masked tail), and 23 weight rows (the AVX2 kernel
    takes 4 or 2 at once where x has few rows, and the rest one at a time); the integer sums are exact, so the
    result is the rounded x's matmul in another float order. For 4- and 8-bit codes with a float16 constant a
    group (Q4_0, Q4_1, Q8_0), both the AVX2 kernel and the 512-bit build's 16-row kernel (16 weight rows at a
    time: 23 rows leave a partial block) give each row exactly its result alone, as Q6_K (and Q4_K in the
    256-bit build) do, whose one row of x takes four weight rows a pass (K 768: three super-groups)."""
    if build != "native" and platform.machine() != "x86_64":
        pytest.skip("an x86 build")
    library = cpu_grouped.build(BUILDS[build]) if BUILDS[build] else None
    generator = torch.Generator().manual_seed(7)
    for cols in (32, 64, 96, 128, 576, 768):  # 768: three super-groups of a K-quant
        if SPECS[kind].super_group and cols % SPECS[kind].super_group:
            continue  # K-quant rows come in super-groups of 256
        weight = parse_blocks(
            quantize(torch.randn(23, cols, generator=generator) * 0.05, kind), kind, (23, cols)
        )
        if not cpu_grouped.reads_int8(weight, library):
            pytest.skip("this build has no integer dot products")
        dense = weight.dequantize().double()
        for rows in range(1, 10):
            x = torch.randn(rows, cols, generator=generator)
            got = cpu_grouped.matmul_int8(x, weight, library)
            expected = (int8_rounded(x).double() @ dense.t()).float()
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"K {cols}, M {rows}")
            alone = torch.cat([cpu_grouped.matmul_int8(x[m : m + 1], weight, library) for m in range(rows)])
            torch.testing.assert_close(got, alone, atol=1e-6, rtol=1e-5)
            # Q6_K in every build, Q4_K in the 256-bit one: one row of x takes four weight rows a pass with
            # each row's arithmetic unchanged (rows4_dot_int8_q4k / _q6k), so alone equals batched.
            exact = ("Q4_0", "Q4_1", "Q8_0", "Q6_K") + (("Q4_K",) if build == "avx2" else ())
            if kind.name in exact:
                assert torch.equal(got, alone), f"K {cols}, M {rows}"
    for cols in (256, 512):  # the K-quants' whole super-groups
        weight = parse_blocks(
            quantize(torch.randn(24, cols, generator=generator) * 0.05, kind), kind, (24, cols)
        )
        x = torch.randn(5, cols, generator=generator)
        expected = (int8_rounded(x).double() @ weight.dequantize().double().t()).float()
        torch.testing.assert_close(
            cpu_grouped.matmul_int8(x, weight, library), expected, atol=1e-5, rtol=1e-4
        )


def stepped_logits(llm: LLM, seed: int, **options: Any) -> torch.Tensor:
    """Logits [48, vocab] of 48 random tokens fed one at a time through a C step described with `options`, over
    one row of 4 pages of the engine's cache."""
    table = PageTable(1, 4, 16, torch.device("cpu"))
    table.append("row", [0, 1, 2, 3])
    step = cpu_decode.describe(llm.loaded.model, llm.engine.runner.kv_cache, table, **options)
    ids = torch.randint(5, 500, (48,), generator=torch.Generator().manual_seed(seed))
    one = torch.zeros(1, dtype=torch.int64)
    return torch.cat([step.step(ids[t : t + 1], one, torch.tensor([t]), [1], [0]) for t in range(48)])


def test_int8_activations_give_the_likely_tokens_the_float32_heads_logits(tmp_path: Path) -> None:
    """Float32 projections and a Q8_0 head: int8 activations change only the head, whose 8 highest logits a
    row are computed again from float32 x (decode.c's rescore_top), so they are the float32 step's, and the
    top token with them."""
    path = write_tiny_gguf(
        tmp_path / "q8-head.gguf",
        arch="qwen3",
        projections=Q.F32,
        # "output.weight" is also a pattern of every attn_output.weight: those are named whole
        types={"output.weight": Q.Q8_0}
        | {f"blk.{i}.attn_output.weight": Q.F32 for i in range(SHAPE["layers"])},
        tied=False,
    )
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB")
    logits = {int8: stepped_logits(llm, seed=0, int8_activations=int8) for int8 in (False, True)}
    # The 8 rescored were the int8 head's highest; one whose float32 value is lower can fall under a 9th.
    top = logits[True].topk(8, dim=-1).indices
    scale = float(logits[False].abs().max())
    same = torch.isclose(
        logits[True].gather(1, top), logits[False].gather(1, top), atol=1e-5 * scale, rtol=1e-5
    )
    assert bool(same[:, 0].all()) and float(same.float().mean()) > 0.9, same
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
    # the other logits are the int8 head's: the rounding shows there
    assert float((logits[True] - logits[False]).abs().max()) > 1e-4 * scale


def test_the_residual_pass_brings_int8_decode_closer_to_float32_activations(files: dict[str, Path]) -> None:
    """The layers' second int8 pass over each row's groups of largest scale (EngineConfig's
    cpu_int8_residual_groups), against the same step on float32 activations over the same tokens."""
    llm = LLM(str(files["llama-q4_1"]), dtype="float32", kv_cache_memory="64MiB")
    runner = llm.engine.runner
    assert runner.cpu_decode is not None
    assert runner.cpu_decode._model.residual_groups == 3  # the engine's default reaches the step
    blocks = [b.weight for b in llm.loaded.model.layers[0].mlp.gate_up_proj.blocks]
    if not all(cpu_grouped.reads_residual(b) for b in blocks):
        pytest.skip("this build's int8 kernel has no residual pass (it needs AVX-512 VNNI)")
    logits = {
        (int8, groups): stepped_logits(llm, seed=1, int8_activations=int8, residual_groups=groups)
        for int8, groups in ((False, 0), (True, 0), (True, 3))
    }
    # at float32's top token, which the int8 head rescores from float32 x: the layers' rounding alone
    top = logits[False, 0].argmax(-1, keepdim=True)
    plain, second = (
        float((logits[True, groups].gather(1, top) - logits[False, 0].gather(1, top)).abs().mean())
        for groups in (0, 3)
    )
    # random weights have no outlier channels: the pass takes off about its share of the groups (3 of 8 and 16)
    assert 0 < second < 0.8 * plain, (second, plain)


@pytest.mark.parametrize("groups", [5, -1, True, 2.0])
def test_cpu_int8_residual_groups_is_checked(groups: object) -> None:
    with pytest.raises(ValueError, match="cpu_int8_residual_groups"):
        LLM(kv_cache_memory="16MiB", cpu_int8_residual_groups=groups)


@pytest.mark.parametrize("name", ["llama-q4_1", "llama-q5_0-f16", "qwen3-q8_0"])
def test_a_step_of_m_rows_equals_m_steps_of_one(files: dict[str, Path], name: str) -> None:
    """The C step at M = 1 to 9 rows (speculative verification's k + 1, batched decode) against each row
    stepped alone over the same pages: the kernels block rows together, the per-row arithmetic stays."""
    llm = LLM(str(files[name]), dtype="float32", kv_cache_memory="64MiB")
    model, cache = llm.loaded.model, llm.engine.runner.kv_cache
    page_size, steps = 16, 3
    table = PageTable(9, 1, page_size, torch.device("cpu"))
    for b in range(9):
        table.append(f"row{b}", [b])
    step = cpu_decode.describe(model, cache, table, int8_activations=True, residual_groups=3)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        ids = torch.randint(5, 500, (steps, rows), generator=torch.Generator().manual_seed(rows))
        index = torch.arange(rows)
        together = [
            step.step(ids[t], index, torch.full((rows,), t), [1] * rows, [0] * rows) for t in range(steps)
        ]
        for m in range(rows):
            one = index[m : m + 1]
            for t in range(steps):
                alone = step.step(ids[t, m : m + 1], one, torch.tensor([t]), [1], [0])
                scale = float(alone.abs().max())
                torch.testing.assert_close(
                    together[t][m : m + 1],
                    alone,
                    atol=1e-5 * scale,
                    rtol=1e-5,
                    msg=f"M {rows} row {m} step {t}",
                )
