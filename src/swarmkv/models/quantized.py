"""Weight formats of the projections, and the int4 layer: `make_linear` builds a float nn.Linear, an int4
`QuantizedLinear`, or a `GGUFLinear` in the grouped layout (models/gguf_linear.py) for "gguf" (a file's own
blocks) and "int8" (8-bit codes in groups of 32 with a scale and a minimum: `gguf_quants.int8_groups`).

The int4 layout, the same on every device while weights load: `qweight` uint8 [N, K / 2], element k in byte
k // 2 (low nibble when k is even), q in 0..15; `scales` and `mins` [N, K / 32]; W[n, k] = q[n, k] *
scales[n, k // 32] + mins[n, k // 32]. GGUF's Q4_0 and Q4_1 blocks are exactly such groups, so those files load
without loss. `finalize()` then fits the layout to the device's kernel: PyTorch's own weight-only kernel on the
CPU (`_weight_int4pack_mm_for_cpu`), the portable Triton dequantising matmul on a GPU (NVIDIA or AMD).
Embeddings and the LM head stay in float (but for "gguf").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

import swarmkv.resolve as resolve
from swarmkv.errors import ConfigError
from swarmkv.kernels.reference import pack_int4, unpack_int4
from swarmkv.models.gguf_quants import INT8_GROUP_SIZE

# "gguf": every tensor as a GGUF file holds it, at its own bits (models/gguf_linear.py).
WeightFormat = resolve.WeightFormat  # the layers' formats; written once, in swarmkv/resolve.py
INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block


def linear_weight_bytes(out_features: int, in_features: int, fmt: WeightFormat, dtype: torch.dtype) -> int:
    """Bytes of one [out, in] linear weight in `fmt`, with its scales (and minimums) in `dtype`."""
    scale = torch.empty((), dtype=dtype).element_size()
    if fmt == "float":
        return out_features * in_features * scale
    if fmt == "int8":  # a float16 scale and minimum a group, whatever the compute dtype
        return out_features * in_features + 2 * out_features * (in_features // INT8_GROUP_SIZE) * 2
    groups = in_features // INT4_GROUP_SIZE
    return out_features * in_features // 2 + 2 * out_features * groups * scale


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in the int4 layout of the module docstring."""

    format: Literal["int4"]
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The dequantised weight's [N, K]."""
        rows, cols = self.qweight.shape
        return rows, cols * 2

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        assert self.mins is not None
        q = unpack_int4(self.qweight).float()
        groups = torch.arange(q.shape[1], device=q.device) // INT4_GROUP_SIZE
        return q * self.scales.float()[:, groups] + self.mins.float()[:, groups]


def quantize_int4(weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Asymmetric int4 in groups of 32: each group's minimum and (max - min) / 15."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    # Round the group constants to their stored dtype first, so q is chosen against what dequantises.
    scales, low = scales.to(scale_dtype).float(), low.to(scale_dtype).float()
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(
        "int4", pack_int4(q.reshape(rows, cols)), scales.to(scale_dtype), low.to(scale_dtype)
    )


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W kept in int4; loaded row slice by row slice, then `finalize()`d."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        """Empty buffers (the model's `.to(dtype)` sets the dtype of scales and bias)."""
        super().__init__()
        if in_features % INT4_GROUP_SIZE:
            raise ConfigError(
                f"int4 weights need input sizes divisible by {INT4_GROUP_SIZE}, got {in_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.kernel: Literal["cpu", "triton"] | None = None
        self.num_sms: int | None = None  # the GPU's SMs (CUs), which size the Triton GEMV's K split
        groups = in_features // INT4_GROUP_SIZE
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("mins", torch.empty(out_features, groups))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_rows(self, start: int, weight: QuantizedWeight) -> None:
        """Copy `weight` into output rows [start, start + N) (a shard of a fused projection)."""
        assert self.kernel is None, "rows load before finalize()"
        rows = weight.qweight.shape[0]
        self.qweight[start : start + rows].copy_(weight.qweight)
        self.scales[start : start + rows].copy_(weight.scales)
        assert weight.mins is not None
        self.mins[start : start + rows].copy_(weight.mins)

    def finalize(self) -> None:
        """Fit the layout to this device's kernel; ConfigError where none runs."""
        device = self.qweight.device
        if device.type == "cpu":
            # The CPU kernel computes (q - 8) * scale + zero: zero = min + 8 * scale.
            q = unpack_int4(self.qweight).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            zeros = self.mins + 8 * self.scales
            scales_and_zeros = torch.stack([self.scales.t(), zeros.t()], dim=-1).contiguous()
            del self.mins
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scales_and_zeros)
            # The CPU kernel takes bfloat16 activations and scales (see forward).
            self.scales = self.scales.to(torch.bfloat16)
            self.kernel = "cpu"
        elif device.type == "cuda":
            import importlib.util

            if importlib.util.find_spec("triton") is None:
                raise ConfigError("int4 weights on a GPU need the triton package (pip install triton)")
            self.kernel = "triton"
            from swarmkv.kernels.quant_gemv import compute_units  # imports triton: only on a GPU

            self.num_sms = compute_units(device)
        else:
            raise ConfigError(f"int4 weights run on the CPU or a CUDA/ROCm GPU, not {device.type!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None, "QuantizedLinear.finalize() was not called"
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "cpu":
            # PyTorch's CPU kernel is fast with bfloat16 activations (about 2x float32's linear at decode)
            # and over 10x slower with float32 ones; the output returns to the model's dtype.
            activations = flat.to(torch.bfloat16)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                activations, self.qweight, INT4_GROUP_SIZE, self.scales
            ).to(flat.dtype)
        else:
            from swarmkv.kernels import quant_matmul  # imports triton: only on a GPU

            out = quant_matmul.int4_matmul(
                flat, self.qweight, self.scales, self.mins, INT4_GROUP_SIZE, num_sms=self.num_sms
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


def make_linear(in_features: int, out_features: int, bias: bool, fmt: WeightFormat) -> nn.Module:
    """A float nn.Linear, an int4 QuantizedLinear, or a GGUFLinear: filled with a file's blocks ("gguf"), or with
    float weights it quantizes to int8 groups as they load ("int8")."""
    if fmt == "float":
        return nn.Linear(in_features, out_features, bias=bias)
    if fmt == "int4":
        return QuantizedLinear(in_features, out_features, bias)
    from swarmkv.models.gguf_linear import GGUFLinear

    if fmt == "int8" and in_features % INT8_GROUP_SIZE:
        raise ConfigError(f"int8 weights need input sizes divisible by {INT8_GROUP_SIZE}, got {in_features}")
    return GGUFLinear(in_features, out_features, bias, int8_from_float=fmt == "int8")


def finalize_quantized(model: nn.Module) -> None:
    """Fit every quantized layer of a loaded model to its device's kernel."""
    from swarmkv.models.gguf_linear import GGUFLinear

    for module in model.modules():
        if isinstance(module, QuantizedLinear | GGUFLinear):
            module.finalize()
