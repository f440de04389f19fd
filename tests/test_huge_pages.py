"""kernels/huge_pages.py: CPU weights and KV slabs in huge-page mappings, with nothing else changed."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swarmkv import LLM, SamplingParams
from swarmkv.kernels import cpu_grouped, huge_pages
from swarmkv.kernels.huge_pages import HUGE_PAGE, huge_zeros, pack_tensors
from swarmkv.models import loader
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import parse_blocks
from swarmkv.models.loader import load_model
from tiny_gguf import write_tiny_gguf

needs_huge_pages = pytest.mark.skipif(
    not huge_pages.huge_pages_supported(), reason="no transparent huge pages here"
)


@pytest.fixture(autouse=True)
def wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Huge pages on, as outside the suite (conftest.py turns them off for the others)."""
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV, raising=False)


def test_the_environment_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("off", "0", "No", "false "):
        monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, value)
        assert not huge_pages.huge_pages_available()
        assert pack_tensors([torch.ones(4)]) == 0
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "on")
    assert huge_pages.huge_pages_available() == huge_pages.huge_pages_supported()


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: its address range
            start, end = (int(a, 16) for a in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_huge_pages
def test_packed_tensors_keep_their_values_views_and_kinds() -> None:
    a = torch.randn(1000, 600)
    view = a[10:20, 5:]
    codes = torch.arange(300_001, dtype=torch.int16)
    param = torch.nn.Parameter(torch.randn(700, 800), requires_grad=False)
    with torch.inference_mode():
        made_in_inference = torch.randn(5000, 100)
    tensors = [a, view, codes, param, made_in_inference]
    before = [t.clone() for t in tensors]
    own_bytes = sum(t.untyped_storage().nbytes() for t in (a, codes, param, made_in_inference))
    assert pack_tensors(tensors) >= own_bytes
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, "one mapping holds them all"
    assert a.data_ptr() % HUGE_PAGE == 0
    a[10, 5] = 123.0  # a view still aliases its base
    assert view[0, 0].item() == 123.0
    assert isinstance(param, torch.nn.Parameter) and view.shape == (10, 595) and codes.dtype == torch.int16


def test_nothing_moves_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    t = torch.randn(100, 100)
    where = t.data_ptr()
    assert pack_tensors([t]) == 0 and t.data_ptr() == where
    z = huge_zeros((3, 4), torch.float16, torch.device("cpu"))
    assert z.dtype == torch.float16 and z.shape == (3, 4) and not z.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_huge_zeros_are_zeros_of_the_shape_and_dtype(dtype: torch.dtype) -> None:
    z = huge_zeros((2, 4096, 3, 64), dtype, torch.device("cpu"))
    assert z.shape == (2, 4096, 3, 64) and z.dtype == dtype and z.is_contiguous()
    assert not z.float().any()
    z[1, 7] = 1.0
    assert z.float().sum().item() == 3 * 64


@needs_huge_pages
def test_huge_zeros_live_in_a_mapping_that_asks_for_huge_pages() -> None:
    """What the code controls: the mapping is advised and eligible, and aligned. Whether the kernel then finds
    free 2 MiB pages depends on the machine's memory (fragmentation, its defrag setting), so it is not asserted."""
    z = huge_zeros((4 * HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))
    z.fill_(1.0)
    fields = mapping_fields(z.data_ptr())
    assert "hg" in fields["VmFlags"].split(), fields["VmFlags"]  # MADV_HUGEPAGE
    if "THPeligible" in fields:
        assert fields["THPeligible"] == "1"
    assert z.data_ptr() % HUGE_PAGE == 0
    # The control is a fresh mapping that was not advised. A plain tensor is no control: torch's allocator advises
    # its own large blocks when THP_MEM_ALLOC_ENABLE is set, and a heap that such a block left behind keeps the flag.
    plain = torch.frombuffer(
        mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
    )
    plain.fill_(1)
    assert "hg" not in mapping_fields(plain.data_ptr()).get("VmFlags", "").split()


@needs_huge_pages
def test_a_layout_cached_before_packing_is_described_again() -> None:
    """cpu_grouped caches a weight's pointers; packing moves them, so the cache must notice."""
    if not cpu_grouped.available():
        pytest.skip("no C kernel here")
    w = parse_blocks(quantize(torch.randn(64, 256), Q.Q4_1), Q.Q4_1, (64, 256))
    x = torch.randn(2, 256)
    expected = cpu_grouped.matmul(x, w)
    old = cpu_grouped.layout_args(w)
    pack_tensors(w.tensors())
    assert cpu_grouped.layout_args(w) != old
    assert torch.equal(cpu_grouped.matmul(x, w), expected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("huge") / "tiny.gguf", "llama", projections=Q.Q4_1)


@needs_huge_pages
def test_a_loaded_model_lives_in_one_mapping_and_answers_the_same(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = load_model(tiny, dtype="float32")
    held = [*packed.model.parameters(), *packed.model.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    monkeypatch.setattr(loader, "pack_tensors", lambda tensors: 0)
    plain = load_model(tiny, dtype="float32")
    assert len({t.untyped_storage().data_ptr() for t in plain.model.parameters()}) > 1
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 300, 12], list(range(40, 90))]
    answers = [
        [o.token_ids for o in LLM(loaded=m, kv_cache_memory="16MiB").generate(prompts, params)]
        for m in (packed, plain)
    ]
    assert answers[0] == answers[1]  # the same arithmetic on the same bytes, wherever they lie
