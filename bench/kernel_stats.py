"""Compile-time statistics of swarmkv's Triton kernels for GPUs this machine need not have.

Each kernel is launched through its public wrapper on CPU tensors of the founding document's shape (hidden 4,096,
32 query heads and 8 KV heads of 128, intermediate 12,288) with the launch intercepted, so what is compiled is
exactly what the wrapper would launch: its block sizes, warps and argument specialisation. It is then compiled for
each target, and the compiled kernel is read for registers, spills, scratch, shared memory and the width in bytes
of every global load a lane issues, attributed to the source line of its `tl.load` (from the line info of the
PTX or AMDGCN assembly).

    python bench/kernel_stats.py                                   # the table, every kernel, every target
    python bench/kernel_stats.py --json stats.json                 # and the figures as JSON
    python bench/kernel_stats.py --cases int4 attention --targets gfx1201 sm_90
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import linecache
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The wrappers must see real JIT functions, not the interpreter's.
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_stats compiles kernels: run it without TRITON_INTERPRET=1")

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "swarmkv", "kernels")
TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),  # H100 / H200
    "gfx1201": GPUTarget("hip", "gfx1201", 32),  # RX 9070 XT (RDNA4), the founding document's card
    "gfx942": GPUTarget("hip", "gfx942", 64),  # MI300X
}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
DECODE_ROWS = (1, 8, 32)
PREFILL_ROWS = 512
PAGE_SIZE = 16  # the default tokens per KV page (core/config.py)
SM_COUNT = (
    64  # the RX 9070 XT's compute units: decides whether a decode GEMV splits K (and launches a reduce)
)


@dataclass(frozen=True)
class Launch:
    """One kernel launch a wrapper made: the JIT function and the arguments it was given."""

    case: str
    config: str
    fn: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def kernel(self) -> str:
        return self.fn.fn.__name__


@dataclass(frozen=True)
class LoadSite:
    """The global loads compiled from one source line: per-lane widths in bytes, and how many instructions."""

    file: str
    line: int
    source: str
    min_bytes: int
    max_bytes: int
    count: int


@dataclass(frozen=True)
class KernelStats:
    """What one compiled kernel uses per thread (lane) on one target."""

    case: str
    config: str
    kernel: str
    target: str
    num_warps: int
    registers: int  # NVIDIA registers / AMD VGPRs per thread
    spilled_bytes: int  # NVIDIA spill stores (bytes); AMD: VGPRs spilled to scratch (count)
    sgpr_spills: int  # AMD scalar registers spilled (into VGPR lanes, not memory); 0 on NVIDIA
    scratch_bytes: int  # local / private memory per thread
    shared_bytes: int
    loads: tuple[LoadSite, ...]

    @property
    def max_load_bytes(self) -> int:
        return max((s.max_bytes for s in self.loads), default=0)

    @property
    def min_load_bytes(self) -> int:
        return min((s.min_bytes for s in self.loads), default=0)


@contextlib.contextmanager
def captured_launches(into: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]]) -> Iterator[None]:
    """Record every `kernel[grid](...)` instead of running it (there is no GPU to run it on)."""
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        into.append((self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


# --- the cases: each calls public wrappers on CPU tensors at one configuration ---------------------------------


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return (
        torch.zeros(shape, dtype=dtype)
        if dtype in (torch.uint8, torch.int8)
        else torch.empty(shape, dtype=dtype)
    )


def _int4_case(rows: int, dtype: torch.dtype) -> None:
    from swarmkv.kernels.quant_matmul import int4_matmul

    x = _empty(rows, HIDDEN, dtype=dtype)
    qweight = _empty(HIDDEN, HIDDEN // 2, dtype=torch.uint8)  # o_proj
    scales = _empty(HIDDEN, HIDDEN // 32, dtype=dtype)
    int4_matmul(x, qweight, scales, scales.clone(), 32, **_split_options())


def _int8_case(rows: int, dtype: torch.dtype) -> None:
    """The weight format int8: 8-bit codes in groups of 32 with a scale and a minimum, on the grouped kernel."""
    from swarmkv.kernels.grouped_matmul import grouped_matmul
    from swarmkv.models.gguf_quants import int8_groups

    weight = int8_groups(torch.zeros(HIDDEN, HIDDEN))  # o_proj
    grouped_matmul(_empty(rows, HIDDEN, dtype=dtype), weight, units=SM_COUNT)


def _split_options() -> dict[str, int]:
    """The SM count, for wrappers that take it (it sizes the K split); the matmuls before issue 27 took none."""
    import inspect

    from swarmkv.kernels.quant_matmul import int4_matmul

    return {"num_sms": SM_COUNT} if "num_sms" in inspect.signature(int4_matmul).parameters else {}


def _gguf_case(kind_name: str, rows: int, dtype: torch.dtype) -> None:
    from swarmkv.kernels.grouped_matmul import grouped_matmul
    from swarmkv.models.gguf_quantize import quantize
    from swarmkv.models.gguf_quants import Q, parse_blocks

    kind = Q[kind_name]
    weight = parse_blocks(quantize(torch.zeros(HIDDEN, HIDDEN), kind), kind, (HIDDEN, HIDDEN))
    grouped_matmul(torch.empty(rows, HIDDEN, dtype=dtype), weight, units=SM_COUNT)


def _gated_delta_case(kind: str, dtype: torch.dtype) -> None:
    """Qwen3.5-9B's linear-attention layer: 16 key heads and 32 value heads of 128, a conv of 4 over 8192 channels."""
    from swarmkv.kernels.gated_delta import causal_conv, gated_delta_recurrent

    tokens = PREFILL_ROWS if kind == "conv prefill" else 8
    starts = torch.arange(0, tokens + 1, tokens // 8, dtype=torch.int32)[:9]
    slots = torch.arange(8, dtype=torch.int32)
    if kind.startswith("conv"):
        channels = 2 * 16 * 128 + 32 * 128
        windows = torch.empty(8, channels, 3, dtype=dtype)
        x, weight = torch.empty(tokens, channels, dtype=dtype), torch.empty(channels, 4, dtype=dtype)
        causal_conv(x, windows, weight, starts, slots, max_tokens=tokens // 8)
    else:
        q, v = torch.empty(tokens, 16, 128, dtype=dtype), torch.empty(tokens, 32, 128, dtype=dtype)
        g, beta = torch.empty(tokens, 32), torch.empty(tokens, 32, dtype=dtype)
        gated_delta_recurrent(q, q.clone(), v, g, beta, torch.empty(8, 32, 128, 128), starts, slots)


def _attention_case(kind: str, dtype: torch.dtype) -> None:
    from swarmkv.engine.triton_attention import PREFIX_TOKENS, extend_tokens
    from swarmkv.kernels.attention import MAX_COLUMNS, attend_tiles, merge_partials, store_kv, tile_tokens

    group = HEADS // KV_HEADS
    tokens = PREFILL_ROWS if kind == "extend" else 8
    q = torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype)
    k_cache = torch.empty(1024, KV_HEADS, HEAD_DIM, dtype=dtype)
    table = torch.zeros(8, 64, dtype=torch.int32)
    tiles = torch.zeros(8, 7, dtype=torch.int32)
    part_out = torch.empty(tokens, HEADS, MAX_COLUMNS, HEAD_DIM)
    part_lse = torch.empty(tokens, HEADS, MAX_COLUMNS)
    common = dict(page_size=PAGE_SIZE)
    if kind == "store_kv":
        k = torch.empty(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
        store_kv(k, k.clone(), k_cache, k_cache.clone(), torch.zeros(tokens, dtype=torch.int64))
    elif kind == "extend":
        out = torch.empty_like(q)
        tpt = extend_tokens(group, dtype)
        attend_tiles(q, k_cache, k_cache.clone(), table, tiles, tokens_per_tile=tpt, out=out, **common)
    elif kind in ("decode", "prefix"):
        tpt = tile_tokens(group, 1 if kind == "decode" else PREFIX_TOKENS)
        attend_tiles(
            q,
            k_cache,
            k_cache.clone(),
            table,
            tiles,
            tokens_per_tile=tpt,
            partials=(part_out, part_lse),
            num_splits=4,
            **common,
        )
    else:
        merge_partials(part_out, part_lse, torch.empty_like(q), 0, 8)


def _norm_case(residual: bool, dtype: torch.dtype) -> None:
    from swarmkv.kernels.norm import add_rms_norm, rms_norm

    x = torch.empty(8, HIDDEN, dtype=dtype)
    weight = torch.empty(HIDDEN, dtype=dtype)
    if residual:
        add_rms_norm(x, x.clone(), weight, 1e-6)
    else:
        rms_norm(x, weight, 1e-6)


def _rotary_case(dtype: torch.dtype) -> None:
    from swarmkv.kernels.rotary import apply_rotary_

    q = torch.empty(8, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.empty(8, KV_HEADS, HEAD_DIM, dtype=dtype)
    apply_rotary_(torch.zeros(8, dtype=torch.int64), q, k, torch.empty(2, 4096, HEAD_DIM, dtype=dtype))


def _activation_case(dtype: torch.dtype) -> None:
    from swarmkv.kernels.activation import silu_and_mul

    silu_and_mul(torch.empty(8, 2 * INTERMEDIATE, dtype=dtype))


def cases(dtype: torch.dtype) -> dict[str, list[tuple[str, Callable[[], None]]]]:
    """Case name -> its configurations, each a label and a call of public wrappers."""
    matmul_rows = [*((f"decode M={m}", m) for m in DECODE_ROWS), (f"prefill M={PREFILL_ROWS}", PREFILL_ROWS)]
    return {
        "int4": [(label, lambda m=m: _int4_case(m, dtype)) for label, m in matmul_rows],
        "int8": [(label, lambda m=m: _int8_case(m, dtype)) for label, m in matmul_rows],
        "gguf": [
            (f"{kind} {label}", lambda kind=kind, m=m: _gguf_case(kind, m, dtype))
            for kind in ("Q4_K", "Q6_K", "Q8_0")
            for label, m in matmul_rows
        ],
        "gated_delta": [
            (kind, lambda kind=kind: _gated_delta_case(kind, dtype))
            for kind in ("conv decode", "conv prefill", "recurrent")
        ],
        "attention": [
            (kind, lambda kind=kind: _attention_case(kind, dtype))
            for kind in ("decode", "prefix", "extend", "merge", "store_kv")
        ],
        "norm": [
            ("rows", lambda: _norm_case(False, dtype)),
            ("rows+residual", lambda: _norm_case(True, dtype)),
        ],
        "rotary": [("rows", lambda: _rotary_case(dtype))],
        "activation": [("rows", lambda: _activation_case(dtype))],
    }


def collect_launches(names: list[str], dtype: torch.dtype, configs: list[str] | None = None) -> list[Launch]:
    """Run the named cases' wrappers (the configurations whose label contains one of `configs`, default all)
    with launches intercepted: a Launch per kernel launched."""
    launches: list[Launch] = []
    for case, configs_of in cases(dtype).items():
        if case not in names:
            continue
        for config, call in configs_of:
            if configs is not None and not any(c in config for c in configs):
                continue
            raw: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []
            with captured_launches(raw):
                call()
            for fn, args, kwargs in raw:
                launches.append(Launch(case, config, fn, args, kwargs))
    return launches


# --- compiling and reading the compiled kernel -------------------------------------------------------------------


def compile_for(launch: Launch, target: GPUTarget) -> Any:
    """Compile the launch for `target` as JITFunction.run would on such a device (same specialisation)."""
    fn = launch.fn
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )


_PTX_LOAD = re.compile(r"\bld\.global\S*")
_PTX_ASYNC = re.compile(
    r"\bcp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)"
)
_AMD_LOAD = re.compile(r"\b(?:global|buffer)_load_(\w+)")
_AMD_WIDTHS = [
    ("dwordx4", 16),
    ("dwordx3", 12),
    ("dwordx2", 8),
    ("dword", 4),
    ("b128", 16),
    ("b96", 12),
    ("b64", 8),
    ("b32", 4),
    ("d16_hi_b16", 2),
    ("d16_b16", 2),
    ("d16_hi_u8", 1),
    ("d16_u8", 1),
    ("d16_hi_i8", 1),
    ("d16_i8", 1),
    ("short", 2),
    ("ushort", 2),
    ("sshort", 2),
    ("u16", 2),
    ("i16", 2),
    ("ubyte", 1),
    ("sbyte", 1),
    ("u8", 1),
    ("i8", 1),
]
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"(?:\s+"([^"]*)")?')


def _ptx_width(token: str) -> int:
    vector = re.search(r"\.v(\d+)\.", token)
    bits = re.search(r"\.[bsuf](\d+)$", token)
    assert bits is not None, f"unparsed PTX load {token}"
    return (int(vector.group(1)) if vector else 1) * int(bits.group(1)) // 8


def _amd_width(suffix: str) -> int:
    for prefix, width in _AMD_WIDTHS:
        if suffix.startswith(prefix):
            return width
    raise AssertionError(f"unparsed AMDGCN load {suffix}")


def load_sites(asm: str, is_ptx: bool) -> tuple[LoadSite, ...]:
    """Every global load in the assembly, grouped by the source file and line its `.loc` names (a load in an
    inlined helper is named by the helper's line)."""
    files: dict[str, str] = {}  # PTX lists its files after the code
    widths: dict[tuple[str, int], list[int]] = {}
    where = ("", 0)
    for text in asm.splitlines():
        file = _FILE.match(text)
        if file:  # PTX: .file 1 "path"; AMDGCN: .file 1 "dir" "name"
            files[file.group(1)] = (
                os.path.join(file.group(2), file.group(3)) if file.group(3) else file.group(2)
            )
            continue
        loc = _LOC.match(text)
        if loc:
            where = (loc.group(1), int(loc.group(2)))
            continue
        code = text.split("//")[0] if is_ptx else text.split(";")[0]
        found: list[int] = []
        if is_ptx:
            found += [_ptx_width(m.group(0)) for m in _PTX_LOAD.finditer(code)]
            found += [int(m.group(1), 0) for m in _PTX_ASYNC.finditer(code)]
        else:
            found += [_amd_width(m.group(1)) for m in _AMD_LOAD.finditer(code)]
        widths.setdefault(where, []).extend(found)
    paths = {(files.get(index, ""), line): w for (index, line), w in widths.items() if w}
    return tuple(
        LoadSite(os.path.basename(path), line, source_line(path, line), min(w), max(w), len(w))
        for (path, line), w in sorted(paths.items())
    )


def source_line(path: str, line: int) -> str:
    """Line `line` of `path`, the file the assembly's line info names. Triton's cache keys a compile by its
    source, not its path, so a cached kernel may name the checkout that first compiled it, since moved or
    deleted: then the file of that name in this checkout's kernels is read."""
    if not os.path.exists(path):
        path = os.path.join(KERNELS_DIR, os.path.basename(path))
    return linecache.getline(path, line).strip()


@functools.cache  # the same kernel recurs across configurations (a split's reduce): ptxas runs once for it
def _ptxas_stats(ptx: str, arch: int) -> tuple[int, int, int]:
    """Registers, spill-store bytes and stack bytes from `ptxas -v` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [
            get_ptxas(arch).path,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
        ]
        log = subprocess.run(
            [*cmd, path, "-o", path + ".o"], capture_output=True, text=True, check=True
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    assert regs is not None, log
    return int(regs.group(1)), int(spills.group(1)) if spills else 0, int(stack.group(1)) if stack else 0


def _amd_field(asm: str, name: str) -> int:
    found = re.search(rf"\.{name}:\s+(\d+)", asm)
    assert found is not None, f"no .{name} in the AMDGCN metadata"
    return int(found.group(1))


def kernel_stats(launch: Launch, target_name: str) -> KernelStats:
    """Compile `launch` for one target and read its resource use."""
    target = TARGETS[target_name]
    compiled = compile_for(launch, target)
    if target.backend == "cuda":
        ptx = compiled.asm["ptx"]
        registers, spilled, scratch = _ptxas_stats(ptx, int(target.arch))
        sgpr_spills = 0
        loads = load_sites(ptx, True)
    else:
        asm = compiled.asm["amdgcn"]
        registers = _amd_field(asm, "vgpr_count")
        spilled = _amd_field(asm, "vgpr_spill_count")
        sgpr_spills = _amd_field(asm, "sgpr_spill_count")
        scratch = _amd_field(asm, "private_segment_fixed_size")
        loads = load_sites(asm, False)
    return KernelStats(
        case=launch.case,
        config=launch.config,
        kernel=launch.kernel,
        target=target_name,
        num_warps=compiled.metadata.num_warps,
        registers=registers,
        spilled_bytes=spilled,
        sgpr_spills=sgpr_spills,
        scratch_bytes=scratch,
        shared_bytes=compiled.metadata.shared,
        loads=loads,
    )


def collect(
    names: list[str], targets: list[str], dtype: torch.dtype, configs: list[str] | None = None
) -> list[KernelStats]:
    """Statistics of every launch of the named cases (and configurations) on every target."""
    return [kernel_stats(launch, t) for launch in collect_launches(names, dtype, configs) for t in targets]


def table(stats: list[KernelStats]) -> str:
    """A fixed-width table, one row per kernel, configuration and target."""
    head = (
        "case",
        "kernel",
        "config",
        "target",
        "warps",
        "regs",
        "spills",
        "sgpr_spill",
        "scratch",
        "shared",
    )
    head = (*head, "load B")
    rows = [
        (
            s.case,
            s.kernel,
            s.config,
            s.target,
            str(s.num_warps),
            str(s.registers),
            str(s.spilled_bytes),
            str(s.sgpr_spills),
            str(s.scratch_bytes),
            str(s.shared_bytes),
            f"{s.min_load_bytes}..{s.max_load_bytes}",
        )
        for s in stats
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    all_cases = list(cases(torch.float16))
    parser.add_argument("--cases", nargs="+", default=all_cases, choices=all_cases, help="kernel families")
    parser.add_argument(
        "--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS), help="GPU targets"
    )
    parser.add_argument("--configs", nargs="+", help="only configurations whose label contains one of these")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--json", metavar="F", help="also write the figures to F as JSON")
    args = parser.parse_args(argv)
    stats = collect(args.cases, args.targets, getattr(torch, args.dtype), args.configs)
    print(
        f"Triton {triton.__version__}, activations {args.dtype}; load B = per-lane global load widths, bytes"
    )
    print(table(stats))
    if args.json:
        with open(args.json, "w") as f:
            records = [
                {
                    **dataclasses.asdict(s),
                    "max_load_bytes": s.max_load_bytes,
                    "min_load_bytes": s.min_load_bytes,
                }
                for s in stats
            ]
            json.dump({"triton": triton.__version__, "dtype": args.dtype, "kernels": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
