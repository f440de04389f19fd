"""The whole-step CPU decode of `kernels/cpu/decode.c`, described to C once: a dense decoder's weights (the
grouped GGUF layout, or float32 row blocks), its KV slabs and page table, as ctypes structures pointing into the
tensors, which this object keeps alive. `step()` then runs one decode step for M rows in one call."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS
from swarmkv.kernels import cpu_grouped
from swarmkv.kernels.cpu_grouped import GroupedQuant
from swarmkv.kernels.cpu_threads import ThreadChoice

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layout(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int),
        ("group", ctypes.c_int),
        ("offset", ctypes.c_int),
        ("low", _P),
        ("high", _P),
        ("s_half", _P),
        ("s_sub", _P),
        ("s_sub_signed", ctypes.c_int),
        ("s_per", ctypes.c_int),
        ("m_half", _P),
        ("m_sub", _P),
        ("m_per", ctypes.c_int),
    ]


class _Block(ctypes.Structure):
    _fields_ = [("start", _I64), ("rows", _I64), ("w", _Layout)]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("N", _I64),
        ("K", _I64),
        ("num_blocks", _I64),
        ("blocks", ctypes.POINTER(_Block)),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("vocab", _I64),
        ("num_layers", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("embed", _Linear),
        ("final_norm", _P),
        ("lm_head", _Linear),
        ("cos_sin", _P),
        ("max_positions", _I64),
        ("page_table", _P),
        ("table_stride", _I64),
        ("page_size", _I64),
        ("int8_activations", ctypes.c_int),
        ("residual_groups", ctypes.c_int),
        ("kv_half", ctypes.c_int),
    ]


Block = GroupedQuant | torch.Tensor  # a float block: float32 rows [rows, K]


@dataclass(frozen=True)
class Linear:
    """A weight [out_features, in_features] as row blocks (start row, block), with an optional float32 bias."""

    in_features: int
    out_features: int
    blocks: list[tuple[int, Block]]
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Layer:
    """One dense decoder layer's weights: norms float32 (q/k norms None where the model has none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class Shape:
    """The model's dimensions and its norms' epsilon."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float


def reads_half_kv(library: ctypes.CDLL | None = None) -> bool:
    """Whether the C step reads float16 KV pages on this build (x86 with F16C)."""
    library = library or cpu_grouped.library()
    return library is not None and bool(library.swarmkv_has_kv_half())


def supports_block(block: Block) -> bool:
    """Whether the C step reads this block: the grouped layout at groups of 16 or 32, or float32 rows."""
    if isinstance(block, torch.Tensor):
        return block.dtype == torch.float32 and block.is_contiguous()
    return block.group_size in (16, 32) and block.bits in (4, 5, 6, 8)


class DecodeModel:
    """A model described to the C decode step, over its KV slabs and page table (tensors that must not move)."""

    def __init__(
        self,
        shape: Shape,
        layers: list[Layer],
        embed: Linear,
        final_norm: torch.Tensor,
        lm_head: Linear,
        cos_sin: torch.Tensor,
        k_slabs: torch.Tensor,
        v_slabs: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
        int8_activations: bool = True,
        residual_groups: int = CPU_INT8_RESIDUAL_GROUPS,
    ) -> None:
        """`k_slabs`, `v_slabs`: float32 or float16 [layers, slots, kv_heads, head_dim] (float16 where
        `reads_half_kv()`); `page_table`: int64 [rows, pages].
        `int8_activations`: projections over 4-, 5- and 8-bit groups of 32 read their input quantised to int8
        per group (llama.cpp's Q8 activations, on the CPU's integer dot products); otherwise float32.
        `residual_groups`: the layers' int8 input also carries a second int8 pass over that many groups a row,
        those of largest scale, where the kernel reads it (`cpu_grouped.reads_residual`)."""
        library = cpu_grouped.library()
        assert library is not None, "the CPU kernels are not built"
        assert k_slabs.dtype == v_slabs.dtype and k_slabs.dtype in (torch.float32, torch.float16)
        assert k_slabs.dtype == torch.float32 or reads_half_kv(library), "this build has no F16C"
        assert page_table.dtype == torch.int64 and page_table.is_contiguous()
        self._library = library
        self._keep: list[object] = [k_slabs, v_slabs, page_table, cos_sin, final_norm]
        self.vocab = shape.vocab
        # Whether a layer projection reads int8 activations (float32 row blocks, and layouts the int8 kernel does
        # not read, take float32 ones): what rounds a decode step beyond float32.
        self.reads_int8 = int8_activations and any(
            cpu_grouped.reads_int8(block, library)
            for layer in layers
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
            for _, block in linear.blocks
            if not isinstance(block, torch.Tensor)
        )
        self._threads: ThreadChoice | None = None
        c_layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            c = c_layers[i]
            c.input_norm, c.post_norm = self._float(layer.input_norm), self._float(layer.post_norm)
            c.q_norm, c.k_norm = self._float(layer.q_norm), self._float(layer.k_norm)
            c.qkv, c.o = self._linear(layer.qkv), self._linear(layer.o)
            c.gate_up, c.down = self._linear(layer.gate_up), self._linear(layer.down)
            c.k_cache, c.v_cache = k_slabs[i].data_ptr(), v_slabs[i].data_ptr()
        self._keep.append(c_layers)
        self._model = _Model(
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate,
            vocab=shape.vocab,
            num_layers=len(layers),
            eps=shape.eps,
            scale=shape.head_dim**-0.5,
            layers=c_layers,
            embed=self._linear(embed),
            final_norm=self._float(final_norm),
            lm_head=self._linear(lm_head),
            cos_sin=cos_sin.data_ptr(),
            max_positions=cos_sin.shape[1],
            page_table=page_table.data_ptr(),
            table_stride=page_table.shape[1],
            page_size=page_size,
            int8_activations=int(int8_activations),
            residual_groups=residual_groups,
            kv_half=int(k_slabs.dtype == torch.float16),
        )

    def _float(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        held = t.detach().float().contiguous()
        self._keep.append(held)
        return held.data_ptr()

    def _linear(self, linear: Linear) -> _Linear:
        blocks = (_Block * len(linear.blocks))()
        for i, (start, block) in enumerate(linear.blocks):
            assert supports_block(block), "a block the C decode step cannot read"
            blocks[i].start, blocks[i].rows = start, int(block.shape[0])
            if isinstance(block, torch.Tensor):
                blocks[i].w = _Layout(bits=0, group=1, offset=0, low=block.data_ptr())
            else:
                blocks[i].w = _Layout(*cpu_grouped.layout_args(block))
            self._keep.append(block)
        self._keep.append(blocks)
        bias = self._float(linear.bias)
        return _Linear(
            N=linear.out_features,
            K=linear.in_features,
            num_blocks=len(linear.blocks),
            blocks=blocks,
            bias=bias,
        )

    def step(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        group_sizes: list[int],
        group_shared: list[int],
    ) -> torch.Tensor:
        """Float32 logits [M, vocab] for M rows each decoding token ids[m] at positions[m] (int64), whose K and
        V are addressed through page-table rows rows[m]. Rows come in groups (sizes summing to M) whose members
        share their first group_shared[g] positions' pages: those keys are read once for the group."""
        count = ids.numel()
        assert sum(group_sizes) == count and len(group_sizes) == len(group_shared)
        ids, rows, positions = (t.to(torch.int64).contiguous() for t in (ids, rows, positions))
        sizes = torch.tensor(group_sizes, dtype=torch.int64)
        shared = torch.tensor(group_shared, dtype=torch.int64)
        logits = torch.empty(count, self.vocab, dtype=torch.float32)
        team = torch.get_num_threads()
        if self._threads is None or self._threads.choices[0] != team:
            self._threads = ThreadChoice(team)

        def run(threads: int) -> int:
            return int(
                self._library.swarmkv_decode_step(
                    ctypes.byref(self._model),
                    count,
                    ids.data_ptr(),
                    rows.data_ptr(),
                    positions.data_ptr(),
                    len(group_sizes),
                    sizes.data_ptr(),
                    shared.data_ptr(),
                    logits.data_ptr(),
                    threads,
                )
            )

        status = self._threads.run(count, run)
        assert status == 0, f"the C decode step refused its input (status {status})"
        return logits
