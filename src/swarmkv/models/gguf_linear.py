"""Layers that hold weights in the grouped layout of `models/gguf_quants.py`: a linear layer whose row blocks
are each a `GroupedQuant` (or a float tensor), and an embedding that dequantises only the rows it looks up. The
weight format "gguf" holds a file's tensors at the file's own bits, and a tied embedding's blocks serve the LM
head as well, once in memory; the weight format "int8" holds the projections of any checkpoint quantized to
8-bit groups (`gguf_quants.int8_groups`) as they load.

On the CPU the matmul runs the C kernel of `kernels/cpu_grouped.py`: at small batches (decode) a GEMV that reads
each weight byte once, at larger ones (prefill) an exact dequantisation into a float tile and torch's matmul, or,
with `prefill_int8` (`EngineConfig.cpu_prefill_int8`), the int8 GEMM over K-quant blocks. Where the C
kernel is unavailable both use the torch dequantisation of `GroupedQuant`, exact but slow. On a CUDA or ROCm GPU
the Triton kernel of `kernels/grouped_matmul.py` reads the same layout, at every batch size.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from swarmkv.kernels import cpu_grouped
from swarmkv.models.gguf_quants import GroupedQuant

# Rows of x the C GEMV serves in one pass over the weights (FAST_ROWS in kernels/cpu/grouped.c); larger batches
# (prefill) dequantise a float tile once and use torch's matmul.
GEMV_MAX_ROWS = 8
Block = GroupedQuant | torch.Tensor  # a float block is held at the compute dtype


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, start + rows) of a weight."""

    start: int
    weight: Block

    @property
    def rows(self) -> int:
        """How many output rows the block fills."""
        return int(self.weight.shape[0])


def gguf_kernels_run_on(device: torch.device) -> bool:
    """Whether GGUF-held layers compute on `device`: the CPU (C or torch), or a GPU with triton."""
    return device.type == "cpu" or (device.type == "cuda" and importlib.util.find_spec("triton") is not None)


def dequantize_block(block: Block, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows of a block (all when `rows` is None), exactly as gguf dequantises them."""
    if isinstance(block, torch.Tensor):
        return (block if rows is None else block[rows]).float()
    if block.low.device.type == "cpu" and cpu_grouped.available():
        return cpu_grouped.dequantize_rows(block, rows)
    return (block if rows is None else block.take_rows(rows)).dequantize()


class HeldBlocks(nn.Module):
    """A layer whose weight is a list of row blocks, each registered as buffers (so bytes and moves see them)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[RowBlock] = []

    def load_block(self, start: int, weight: Block) -> None:
        """Hold `weight` as output rows [start, start + rows)."""
        self.blocks.append(RowBlock(start, weight))
        self._register()

    def _register(self) -> None:
        for name in [n for n, _ in self.named_buffers(recurse=False)]:
            delattr(self, name)
        for i, block in enumerate(self.blocks):
            held = block.weight.tensors() if isinstance(block.weight, GroupedQuant) else [block.weight]
            for j, tensor in enumerate(held):
                self.register_buffer(f"block{i}_{j}", tensor, persistent=False)


class GGUFLinear(HeldBlocks):
    """y = x W^T (+ b) with W held as row blocks at the file's bits; filled by `load_block`, then `finalize()`d."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, int8_from_float: bool = False
    ) -> None:
        """No blocks yet (the loader adds them); the bias, if any, is a float parameter. `int8_from_float`:
        the weight format "int8": the loader quantizes float weights to int8 groups before `load_block`. `kernel`:
        "auto" is Triton on a GPU and C on the CPU; "triton" takes the Triton kernel on the CPU too (its
        interpreter, for tests)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.int8_from_float = int8_from_float
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: Literal["auto", "triton"] = "auto"
        # Batches past GEMV_MAX_ROWS multiply K-quant blocks on int8 activations (`use_prefill_int8`); off, every
        # block is dequantised exactly for a float matmul.
        self.prefill_int8 = False

    def share_blocks(self, other: HeldBlocks) -> None:
        """Hold the same blocks as `other` (an LM head tied to the embedding): no bytes of its own."""
        self.blocks = list(other.blocks)
        self._register()

    def finalize(self) -> None:
        """Check the blocks tile the output rows, and stack adjacent blocks of one kind into one (fewer calls).
        A tied LM head has none yet: it shares the embedding's after loading."""
        if not self.blocks:
            return
        runs: list[list[RowBlock]] = []  # adjacent blocks of one kind, stacked once each
        for block in sorted(self.blocks, key=lambda b: b.start):
            if runs and _stackable(runs[-1][-1].weight, block.weight):
                runs[-1].append(block)
            else:
                runs.append([block])
        merged = [RowBlock(run[0].start, _stack([b.weight for b in run])) for run in runs]
        covered = 0
        for block in merged:
            assert block.start == covered, "row blocks must tile the weight"
            covered += block.rows
        assert covered == self.out_features, f"row blocks cover {covered} of {self.out_features} rows"
        self.blocks = merged
        self._register()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        return torch.cat([dequantize_block(b.weight) for b in self.blocks])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" or self.kernel == "triton":
            return self._forward_triton(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        kernels = x.device.type == "cpu" and cpu_grouped.available()
        gemv = flat.shape[0] <= GEMV_MAX_ROWS and kernels
        gemm = not gemv and self.prefill_int8 and kernels
        wide = flat.float().contiguous() if gemv or gemm or flat.dtype == torch.float32 else flat
        for block in self.blocks:
            dest = out[:, block.start : block.start + block.rows]
            if gemv and isinstance(block.weight, GroupedQuant):
                cpu_grouped.matmul(wide, block.weight, dest)
            elif (
                gemm and isinstance(block.weight, GroupedQuant) and cpu_grouped.gemm_int8_reads(block.weight)
            ):
                cpu_grouped.gemm_int8(wide, block.weight, dest)
            else:
                dest.copy_(wide @ dequantize_block(block.weight).to(wide.dtype).t())
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def _forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """Each block's rows by the grouped Triton kernel (float blocks by torch's matmul), in x's dtype."""
        from swarmkv.kernels import grouped_matmul  # imports triton: only where it runs

        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(flat.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for block in self.blocks:
            dest = out[:, block.start : block.start + block.rows]
            if isinstance(block.weight, GroupedQuant):
                grouped_matmul.grouped_matmul(flat, block.weight, out=dest)
            else:
                dest.copy_(flat @ block.weight.to(x.dtype).t())
        if self.bias is not None:
            out += self.bias.to(x.dtype)
        return out.reshape(*lead, self.out_features)


class GGUFEmbedding(HeldBlocks):
    """Token embedding held as the file's row blocks; a lookup dequantises only the rows it needs."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        """No blocks yet; `dtype` is the compute dtype of what a lookup returns."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = torch.float32

    def finalize(self, dtype: torch.dtype) -> None:
        """One block covering the vocabulary; lookups return `dtype`."""
        assert len(self.blocks) == 1 and self.blocks[0].rows == self.num_embeddings
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_block(self.blocks[0].weight, input_ids.reshape(-1))
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)


def _stackable(a: Block, b: Block) -> bool:
    if isinstance(a, GroupedQuant) and isinstance(b, GroupedQuant):
        return a.kind() == b.kind()
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _stack(weights: list[Block]) -> Block:
    if len(weights) == 1:
        return weights[0]
    if isinstance(weights[0], GroupedQuant):
        return GroupedQuant.cat_rows([w for w in weights if isinstance(w, GroupedQuant)])
    return torch.cat([w for w in weights if isinstance(w, torch.Tensor)])


def use_prefill_int8(model: nn.Module, on: bool) -> int:
    """Set every GGUF-held linear layer's `prefill_int8` (`swarmkv.resolve.cpu_prefill_int8` decides `on`);
    returns how many layers hold a block the int8 GEMM reads."""
    reading = 0
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.prefill_int8 = on
            blocks = [b.weight for b in module.blocks if isinstance(b.weight, GroupedQuant)]
            reading += any(cpu_grouped.gemm_int8_reads(w) for w in blocks)
    return reading


def gguf_modules(model: nn.Module) -> dict[str, GGUFLinear | GGUFEmbedding]:
    """Every GGUF-held layer of a model by its weight's parameter name."""
    return {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, GGUFLinear | GGUFEmbedding)
    }
