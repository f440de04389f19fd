"""The whole-step CPU decode of `kernels/cpu/decode.c`, described to C once: a decoder's weights (the grouped
GGUF layout, or float32 row blocks), its KV slabs and page table, and a hybrid's recurrent-state tensors, as
ctypes structures pointing into the tensors, which this object keeps alive. `step()` then runs one decode step
for M rows in one call; a hybrid's speculative chunk is a row per position, and the states after each position
go to buffers this object owns and reuses step to step (`KeptRows`, `kept_states`)."""

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
        ("linear", ctypes.c_int),
        ("conv_w", _P),
        ("neg_a", _P),
        ("dt_bias", _P),
        ("delta_norm", _P),
        ("conv_state", _P),
        ("ssm_state", _P),
        ("state_layer", _I64),
    ]


class _Kept(ctypes.Structure):
    _fields_ = [
        ("conv_index", _P),
        ("ssm_index", _P),
        ("conv", _P),
        ("ssm", _P),
        ("conv_count", _I64),
        ("ssm_count", _I64),
    ]


class _DeltaShape(ctypes.Structure):
    _fields_ = [
        ("key_heads", _I64),
        ("value_heads", _I64),
        ("key_dim", _I64),
        ("value_dim", _I64),
        ("conv_kernel", _I64),
        ("tiled", ctypes.c_int),
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
        ("rotary_dim", _I64),
        ("attn_gate", ctypes.c_int),
        ("delta", _DeltaShape),
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
class DeltaNet:
    """A Gated DeltaNet layer's own weights beside its projections (its `Layer.qkv` is in_proj's rows followed by
    in_proj_ba's, beta's logits then the decay's), and its slice of the state tensors:
    conv taps [channels, kernel], -e^A_log and the decay's bias [value heads], the gated norm's weight [value dim];
    conv_state [slots, channels, kernel - 1] and ssm_state [slots, value heads, key dim, value dim], float32, the
    state tensors' `state_layer`-th (the layer's index among the linear layers)."""

    conv_weight: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    state_layer: int = 0


@dataclass(frozen=True)
class Layer:
    """One decoder layer's weights: norms float32 (q/k norms None where the model has none). An attention layer
    reads its KV slabs (`kv`: its index among attention layers); a Gated DeltaNet layer (`delta` set) takes
    `qkv` as in_proj (q, k, v | z) and `o` as out_proj."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    kv: int | None = None
    delta: DeltaNet | None = None


@dataclass(frozen=True)
class DeltaShape:
    """A hybrid's Gated DeltaNet layers: heads and head sizes, the conv's taps, and the value heads' order
    (tiled: value head j reads key head j % key_heads)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    tiled: bool


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
    rotary_dim: int | None = None  # None: the whole head rotates
    attn_gate: bool = False  # q's projection also gives each head a sigmoid gate on its output
    delta: DeltaShape | None = None  # a hybrid's linear-attention layers


@dataclass(frozen=True)
class KeptRows:
    """Which rows of a hybrid's step keep their states after them (a speculative chunk's positions, for the
    rewind): row m's conv window goes to position `conv_index[m]` of the step's kept windows, and its delta-rule
    state to position `ssm_index[m]` of the kept states instead of its slot (int64 [M], contiguous; negative: no window kept,
    and the state stays in the slot only, as a chunk's last position's does). `num_conv`, `num_ssm`: the positions
    kept (`DecodeModel.kept_states` reads them after the step)."""

    conv_index: torch.Tensor
    ssm_index: torch.Tensor
    num_conv: int
    num_ssm: int


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
        # the step's own declaration (a fresh function object): the model, rows, ids, page-table rows,
        # positions, groups, their sizes and shared positions, each row's state slot and the kept states
        # (hybrids), the logits, threads
        self._step = library["swarmkv_decode_step"]
        self._step.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, ctypes.c_int]
        self._step.restype = ctypes.c_int
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
            if layer.delta is not None:
                self._describe_delta(c, layer.delta)
                continue
            kv = i if layer.kv is None else layer.kv
            c.k_cache, c.v_cache = k_slabs[kv].data_ptr(), v_slabs[kv].data_ptr()
        self._keep.append(c_layers)
        self.hybrid = shape.delta is not None
        delta = shape.delta
        # The kept states' buffers, grown to the most positions a step has kept (never shrunk: a fresh
        # allocation's first touch costs page faults every step). Shapes [linear layers, positions, ...].
        self._linear_layers = sum(layer.delta is not None for layer in layers)
        state_shapes = [(layer.delta.conv_state, layer.delta.ssm_state) for layer in layers if layer.delta]
        self._conv_shape = tuple(state_shapes[0][0].shape[1:]) if state_shapes else ()
        self._ssm_shape = tuple(state_shapes[0][1].shape[1:]) if state_shapes else ()
        self._kept_conv = torch.empty(0)
        self._kept_ssm = torch.empty(0)
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
            rotary_dim=cos_sin.shape[-1],
            attn_gate=int(shape.attn_gate),
            delta=_DeltaShape(
                key_heads=delta.key_heads if delta else 0,
                value_heads=delta.value_heads if delta else 0,
                key_dim=delta.key_dim if delta else 0,
                value_dim=delta.value_dim if delta else 0,
                conv_kernel=delta.conv_kernel if delta else 0,
                tiled=int(delta.tiled) if delta else 0,
            ),
        )

    def _describe_delta(self, c: _Layer, delta: DeltaNet) -> None:
        """A Gated DeltaNet layer's own fields (its state tensors are the engine's, written in place)."""
        for state in (delta.conv_state, delta.ssm_state):
            assert state.dtype == torch.float32 and state.is_contiguous(), "states are float32, contiguous"
            self._keep.append(state)
        c.linear = 1
        c.conv_w = self._float(delta.conv_weight)
        c.neg_a, c.dt_bias = self._float(delta.neg_a), self._float(delta.dt_bias)
        c.delta_norm = self._float(delta.norm)
        c.conv_state, c.ssm_state = delta.conv_state.data_ptr(), delta.ssm_state.data_ptr()
        c.state_layer = delta.state_layer

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
        state_slots: torch.Tensor | None = None,
        kept: KeptRows | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [M, vocab] for M rows each decoding token ids[m] at positions[m] (int64), whose K and
        V are addressed through page-table rows rows[m]. Rows come in groups (sizes summing to M) whose members
        share their first group_shared[g] positions' pages: those keys are read once for the group. A hybrid's
        row m continues the recurrent state in slot state_slots[m], which the step updates in place; rows of
        one slot run in position order, each from the state the one before left, and `kept` names the rows
        whose states after them are kept (`kept_states` then holds them, until the next step with `kept`).
        `hidden`: a float32 [M, hidden] tensor the rows' last hidden states (after the final norm) go to."""
        count = ids.numel()
        assert sum(group_sizes) == count and len(group_sizes) == len(group_shared)
        assert (state_slots is not None) == self.hybrid, (
            "a hybrid's rows, and only a hybrid's, carry state slots"
        )
        ids, rows, positions = (t.to(torch.int64).contiguous() for t in (ids, rows, positions))
        slots = None if state_slots is None else state_slots.to(torch.int64).contiguous()
        assert hidden is None or (
            hidden.dtype == torch.float32 and hidden.is_contiguous() and hidden.shape[0] == count
        )
        c_kept = None
        if kept is not None:
            assert self.hybrid and kept.conv_index.numel() == kept.ssm_index.numel() == count
            c_kept = self._describe_kept(kept)
        sizes = torch.tensor(group_sizes, dtype=torch.int64)
        shared = torch.tensor(group_shared, dtype=torch.int64)
        logits = torch.empty(count, self.vocab, dtype=torch.float32)
        team = torch.get_num_threads()
        if self._threads is None or self._threads.choices[0] != team:
            self._threads = ThreadChoice(team)

        def run(threads: int) -> int:
            return int(
                self._step(
                    ctypes.byref(self._model),
                    count,
                    ids.data_ptr(),
                    rows.data_ptr(),
                    positions.data_ptr(),
                    len(group_sizes),
                    sizes.data_ptr(),
                    shared.data_ptr(),
                    None if slots is None else slots.data_ptr(),
                    None if c_kept is None else ctypes.addressof(c_kept),
                    None if hidden is None else hidden.data_ptr(),
                    logits.data_ptr(),
                    threads,
                )
            )

        status = self._threads.run(count, run)
        assert status == 0, f"the C decode step refused its input (status {status})"
        return logits

    def kept_states(self, kept: KeptRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The states the last step kept for `kept`: conv windows [linear layers, num_conv, channels, kernel - 1]
        and delta-rule states [linear layers, num_ssm, value heads, key dim, value dim], views of buffers the next
        step that keeps states overwrites."""
        return self._kept_conv[:, : kept.num_conv], self._kept_ssm[:, : kept.num_ssm]

    def _describe_kept(self, kept: KeptRows) -> _Kept:
        """`kept` as the C step reads it, over buffers grown to hold its positions."""
        for index in (kept.conv_index, kept.ssm_index):
            assert index.dtype == torch.int64 and index.is_contiguous()
        if self._kept_conv.dim() < 2 or self._kept_conv.shape[1] < kept.num_conv:
            self._kept_conv = torch.empty(
                (self._linear_layers, kept.num_conv, *self._conv_shape), dtype=torch.float32
            )
        if self._kept_ssm.dim() < 2 or self._kept_ssm.shape[1] < kept.num_ssm:
            self._kept_ssm = torch.empty(
                (self._linear_layers, kept.num_ssm, *self._ssm_shape), dtype=torch.float32
            )
        return _Kept(
            conv_index=kept.conv_index.data_ptr(),
            ssm_index=kept.ssm_index.data_ptr(),
            conv=self._kept_conv.data_ptr(),
            ssm=self._kept_ssm.data_ptr(),
            conv_count=self._kept_conv.shape[1],
            ssm_count=self._kept_ssm.shape[1],
        )
