"""The CPU kernel over the grouped quantized layout (`models/gguf_quants.GroupedQuant`): a matmul that reads
each weight byte once (decode's GEMV and small batches) and an exact row dequantisation (embedding lookups,
prefill tiles). It is portable C (`kernels/cpu/grouped.c`), built once per machine with the system's C compiler
into a cache folder and called through ctypes (one library with `kernels/cpu/decode.c`, the whole-step decode
of `kernels/cpu_decode.py`, which includes this file's source); where no compiler is found, `available()` is False and callers
use the torch path of `models/gguf_linear.py`. `SWARMKV_CPU_KERNELS=torch` forces that path."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch


class GroupConstants(Protocol):
    """A layout's per-group scales or minimums (`models.gguf_quants.GroupConstants`)."""

    @property
    def values(self) -> torch.Tensor: ...

    @property
    def outer(self) -> torch.Tensor | None: ...


class GroupedQuant(Protocol):
    """What the kernel reads of a weight in the grouped layout (`models.gguf_quants.GroupedQuant`; kernels/ sits
    below models/, so it is described here, not imported)."""

    @property
    def bits(self) -> int: ...

    @property
    def group_size(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def low(self) -> torch.Tensor: ...

    @property
    def high(self) -> torch.Tensor | None: ...

    @property
    def scales(self) -> GroupConstants: ...

    @property
    def mins(self) -> GroupConstants | None: ...

    @property
    def shape(self) -> tuple[int, int]: ...


log = logging.getLogger(__name__)
SOURCES = Path(__file__).with_name("cpu")
SOURCE = SOURCES / "decode.c"  # includes grouped.c: one translation unit
# -ffp-contract=off keeps the dequantisation's s * q + m two roundings, as gguf's float32 numpy computes it;
# `omp simd` lets the dot products vectorise anyway.
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
LIBS = ["-lm"]
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _arch_flags() -> list[str]:
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else ["-mcpu=native"]


def _cache_dir() -> Path:
    root = os.environ.get("SWARMKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swarmkv"
    )
    return Path(root) / "kernels"


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SWARMKV_CPU_KERNELS", "").lower() == "torch":
        return None
    return build(tuple(_arch_flags()))


@cache
def build(arch: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel built for `arch` (compiler flags: this machine's by default; the tests also build the AVX2
    and plain-C variants), or None when it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: quantized GGUF weights run on the slower torch path")
        return None
    flags = [*FLAGS, *arch]
    source = b"".join(path.read_bytes() for path in sorted(SOURCES.glob("*.c")))
    key = hashlib.sha256(source + " ".join([compiler, *flags, platform.processor()]).encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / f"grouped-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built), *LIBS],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                log.warning(
                    "building the CPU quantized kernel failed, using torch: %s", result.stderr[-2000:]
                )
                return None
            os.replace(built, target)  # atomic: concurrent builders agree on one file
    library = ctypes.CDLL(str(target))
    common: list[Any] = [_INT, _INT, _INT, _PTR, _PTR, _PTR, _PTR, _INT, _INT, _PTR, _PTR, _INT, _INT]
    library.swarmkv_grouped_matmul.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _I64, *common]
    int8_common = [*common[:-1], _INT, _INT]  # the residual pass's groups a row before the threads
    library.swarmkv_grouped_matmul_int8.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _I64, *int8_common]
    library.swarmkv_grouped_matmul_int8.restype = library.swarmkv_has_int8_dot.restype = _INT
    library.swarmkv_int8_reads_residual.argtypes = common[:-1]
    library.swarmkv_int8_reads_residual.restype = _INT
    library.swarmkv_has_kv_half.restype = _INT
    # swarmkv_decode_step is declared where it is called (kernels/cpu_decode.py, a fresh function object)
    library.swarmkv_grouped_dequantize.argtypes = [_I64, _I64, _PTR, _PTR, *common]
    library.swarmkv_grouped_matmul.restype = library.swarmkv_grouped_dequantize.restype = _INT
    library.swarmkv_grouped_gemm_int8.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _I64, *common]
    library.swarmkv_gemm_int8_reads.argtypes = common[:-1]
    library.swarmkv_grouped_gemm_int8.restype = library.swarmkv_gemm_int8_reads.restype = _INT
    library.swarmkv_gemm_int8_vector.restype = _INT
    return library


def library() -> ctypes.CDLL | None:
    """This machine's build of the kernels (None where it cannot be built, or `SWARMKV_CPU_KERNELS=torch`)."""
    return _library()


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine."""
    return _library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layout_args(w: GroupedQuant) -> tuple[object, ...]:
    """The kernel's description of a layout (pointers into `w`'s tensors), cached on the object while its codes
    stay where they were (`huge_pages.pack_tensors` moves a storage and re-points its tensors)."""
    cached = _ARGS.get(id(w))
    if cached is not None and cached[0] is w and cached[1] == w.low.data_ptr():
        return cached[2]

    def constants(c: GroupConstants | None) -> tuple[int | None, int | None, int, int]:
        if c is None:
            return None, None, 0, 1
        if c.outer is None:
            return c.values.view(torch.int16).data_ptr(), None, 0, 1
        per = c.values.shape[1] // c.outer.shape[1]
        assert per & (per - 1) == 0, "the kernel takes a power-of-two groups per super-group"
        return (
            c.outer.view(torch.int16).data_ptr(),
            c.values.data_ptr(),
            int(c.values.dtype == torch.int8),
            per,
        )

    s_half, s_sub, s_signed, s_per = constants(w.scales)
    m_half, m_sub, _, m_per = constants(w.mins)
    args: tuple[object, ...] = (w.bits, w.group_size, w.offset, _ptr(w.low), _ptr(w.high), s_half, s_sub)
    args += (s_signed, s_per, m_half, m_sub, m_per)
    if len(_ARGS) > 4096:
        _ARGS.clear()
    _ARGS[id(w)] = (w, w.low.data_ptr(), args)
    return args


_ARGS: dict[int, tuple[GroupedQuant, int, tuple[object, ...]]] = {}


def matmul(
    x: torch.Tensor, w: GroupedQuant, out: torch.Tensor | None = None, library: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) times W^T -> [M, N] float32; `out` may be a column slice of a wider
    output (row stride its own). `library`: a `build` of the kernel other than this machine's."""
    library = library or _library()
    assert library is not None
    status, out = _call_matmul(library.swarmkv_grouped_matmul, x, w, out)
    assert status == 0, "the grouped matmul refused its layout"
    return out


def _call_matmul(
    kernel: Any, x: torch.Tensor, w: GroupedQuant, out: torch.Tensor | None
) -> tuple[int, torch.Tensor]:
    """One of the C matmuls over x [M, K] float32 and W's layout into `out` ([M, N], made if None, its row
    stride its own): the kernel's status and `out`."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    rows, cols = w.shape
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, rows, dtype=torch.float32)
    assert out.shape == (m, rows) and out.stride(1) == 1
    status = kernel(
        m, rows, cols, x.data_ptr(), out.data_ptr(), out.stride(0), *layout_args(w), torch.get_num_threads()
    )
    return int(status), out


def has_int8_dot(library: ctypes.CDLL | None = None) -> bool:
    """Whether the build has the integer dot products of int8 activations (x86 with AVX2; else float only)."""
    library = library or _library()
    return library is not None and bool(library.swarmkv_has_int8_dot())


def reads_int8(w: GroupedQuant, library: ctypes.CDLL | None = None) -> bool:
    """Whether `matmul_int8` (and the decode step's int8 activations) reads this layout with this build: groups
    of 32 at 4, 5 or 8 bits, and Q6_K's 6 bits in groups of 16 under super-groups (`kquant_int8_reads`)."""
    six_bit_k = w.group_size == 16 and w.bits == 6 and w.scales.outer is not None
    return (six_bit_k or (w.group_size == 32 and w.bits in (4, 5, 8))) and has_int8_dot(library)


def reads_residual(w: GroupedQuant, library: ctypes.CDLL | None = None) -> bool:
    """Whether the int8 kernel of this build reads the residual pass for this layout (`matmul_int8`)."""
    library = library or _library()
    if library is None or not reads_int8(w, library):
        return False
    return bool(library.swarmkv_int8_reads_residual(*layout_args(w)))


def matmul_int8(
    x: torch.Tensor, w: GroupedQuant, library: ctypes.CDLL | None = None, residual_groups: int = 0
) -> torch.Tensor:
    """x [M, K] float32 quantised to int8 per group of 32 (scale max |x| / 127), times W^T -> [M, N] float32,
    the dot products in integers; for layouts `reads_int8` accepts. Where `reads_residual`, each row's
    `residual_groups` groups of largest scale also add what the first pass left of them, rounded the same way."""
    library = library or _library()
    assert library is not None and x.dtype == torch.float32 and x.is_contiguous() and reads_int8(w, library)
    rows, cols = w.shape
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    status = library.swarmkv_grouped_matmul_int8(
        x.shape[0],
        rows,
        cols,
        x.data_ptr(),
        out.data_ptr(),
        rows,
        *layout_args(w),
        residual_groups,
        torch.get_num_threads(),
    )
    assert status == 0, "the int8 grouped matmul refused its layout"
    return out


def has_int8_gemm(library: ctypes.CDLL | None = None) -> bool:
    """Whether the build has the int8 GEMM's vector kernel (x86 with AVX2; else plain C, slower than float)."""
    library = library or _library()
    return library is not None and bool(library.swarmkv_gemm_int8_vector())


def gemm_int8_reads(w: GroupedQuant, library: ctypes.CDLL | None = None) -> bool:
    """Whether `gemm_int8` reads this layout: the K-quants Q4_K, Q5_K and Q6_K, K a multiple of 256."""
    library = library or _library()
    return (
        library is not None
        and w.shape[1] % 256 == 0
        and bool(library.swarmkv_gemm_int8_reads(*layout_args(w)))
    )


def gemm_int8(
    x: torch.Tensor, w: GroupedQuant, out: torch.Tensor | None = None, library: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) quantised to int8 per super-group of 256 (scale max |x| / 127, as
    llama.cpp's Q8_K), times W^T -> [M, N] float32, the sub-scales and dot products in integers; a prefill
    chunk's GEMM, for layouts `gemm_int8_reads` accepts. `out` may be a column slice of a wider output."""
    library = library or _library()
    assert library is not None
    status, out = _call_matmul(library.swarmkv_grouped_gemm_int8, x, w, out)
    assert status == 0, f"the int8 GEMM refused its layout or ran out of memory (status {status})"
    return out


def dequantize_rows(
    w: GroupedQuant, rows: torch.Tensor | None = None, library: ctypes.CDLL | None = None
) -> torch.Tensor:
    """The float32 weight's rows `rows` (int64 indices; all rows when None), exact as `w.dequantize()`."""
    library = library or _library()
    assert library is not None
    count, cols = (w.shape[0] if rows is None else rows.numel()), w.shape[1]
    out = torch.empty(count, cols, dtype=torch.float32)
    index = None if rows is None else rows.to(torch.int64).contiguous()
    status = library.swarmkv_grouped_dequantize(
        count, cols, _ptr(index), out.data_ptr(), *layout_args(w), torch.get_num_threads()
    )
    assert status == 0, "the grouped dequantisation refused its layout"
    return out
