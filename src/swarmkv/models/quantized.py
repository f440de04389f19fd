"""Weight-only quantized linear layers: int8 per output channel, int4 in groups of 32 with a minimum.

Layouts, the same on every device while weights load:
- int8: `qweight` int8 [N, K], `scales` [N]; W[n, k] = qweight[n, k] * scales[n].
- int4: `qweight` uint8 [N, K / 2], element k in byte k // 2 (low nibble when k is even), q in 0..15;
  `scales` and `mins` [N, K / 32]; W[n, k] = q[n, k] * scales[n, k // 32] + mins[n, k // 32]. GGUF's Q4_0 and
  Q4_1 blocks are exactly such groups, so those files load without loss.
`finalize()` then fits the layout to the device's kernel: PyTorch's own weight-only kernels on the CPU
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), the portable Triton dequantising matmul on a GPU
(NVIDIA or AMD). Embeddings and the LM head stay in float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from swarmkv.errors import ConfigError
from swarmkv.kernels.reference import pack_int4, unpack_int4

# "gguf": every tensor as a GGUF file holds it, at its own bits (models/gguf_linear.py).
WeightFormat = Literal["float", "int8", "int4", "gguf"]
INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block


def linear_weight_bytes(out_features: int, in_features: int, fmt: WeightFormat, dtype: torch.dtype) -> int:
    """Bytes of one [out, in] linear weight in `fmt`, with its scales (and minimums) in `dtype`."""
    scale = torch.empty((), dtype=dtype).element_size()
    if fmt == "float":
        return out_features * in_features * scale
    if fmt == "int8":
        return out_features * in_features + out_features * scale
    groups = in_features // INT4_GROUP_SIZE
    return out_features * in_features // 2 + 2 * out_features * groups * scale


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in the int8 or int4 layout of the module docstring."""

    format: Literal["int8", "int4"]
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The dequantised weight's [N, K]."""
        rows, cols = self.qweight.shape
        return rows, cols * (2 if self.format == "int4" else 1)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        if self.format == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        assert self.mins is not None
        q = unpack_int4(self.qweight).float()
        groups = torch.arange(q.shape[1], device=q.device) // INT4_GROUP_SIZE
        return q * self.scales.float()[:, groups] + self.mins.float()[:, groups]


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Symmetric int8 per output channel: absmax / 127, rounded up to a bfloat16 value.

    PyTorch's CPU kernel reads the scales in bfloat16 (`finalize`). Codes chosen against a float32 scale and
    then multiplied by its bfloat16 rounding would carry that rounding (up to 2^-9 of the scale) into every
    weight of the channel alike, an error that adds up over K instead of averaging out. Over 1,024 tokens of
    the README on the embedded model, top-1 agreement with float was 94.9% that way and is 96.2% with codes
    chosen against the bfloat16 scale. Rounding up keeps every code within +-127. A bfloat16 value is also
    exact in float32, and in float16 for scales above 2^-14 (the GPU kernel reads scales in the model's dtype).
    """
    wide = weight.float()
    exact = (wide.abs().amax(dim=1) / 127).clamp(min=1e-12)
    rounded = exact.to(torch.bfloat16)
    above = torch.nextafter(rounded, torch.full_like(rounded, torch.inf))
    scales = torch.where(rounded.float() < exact, above, rounded).float()
    q = torch.round(wide / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales.to(scale_dtype))


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


def quantize(weight: torch.Tensor, fmt: Literal["int8", "int4"], scale_dtype: torch.dtype) -> QuantizedWeight:
    """A float weight [N, K] in `fmt`."""
    return quantize_int8(weight, scale_dtype) if fmt == "int8" else quantize_int4(weight, scale_dtype)


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W kept in int8 or int4; loaded row slice by row slice, then `finalize()`d."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, in_features: int, out_features: int, fmt: Literal["int8", "int4"], bias: bool) -> None:
        """Empty buffers (the model's `.to(dtype)` sets the dtype of scales and bias)."""
        super().__init__()
        if fmt == "int4" and in_features % INT4_GROUP_SIZE:
            raise ConfigError(
                f"int4 weights need input sizes divisible by {INT4_GROUP_SIZE}, got {in_features}"
            )
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        self.kernel: Literal["cpu", "triton"] | None = None
        self.num_sms: int | None = None  # the GPU's SMs (CUs), which size the Triton GEMV's K split
        if fmt == "int8":
            self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(out_features))
        else:
            groups = in_features // INT4_GROUP_SIZE
            self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(out_features, groups))
            self.register_buffer("mins", torch.empty(out_features, groups))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_rows(self, start: int, weight: QuantizedWeight) -> None:
        """Copy `weight` into output rows [start, start + N) (a shard of a fused projection)."""
        assert weight.format == self.format and self.kernel is None
        rows = weight.qweight.shape[0]
        self.qweight[start : start + rows].copy_(weight.qweight)
        self.scales[start : start + rows].copy_(weight.scales)
        if weight.mins is not None:
            self.mins[start : start + rows].copy_(weight.mins)

    def finalize(self) -> None:
        """Fit the layout to this device's kernel; ConfigError where none runs."""
        device = self.qweight.device
        if device.type == "cpu":
            if self.format == "int4":
                # The CPU kernel computes (q - 8) * scale + zero: zero = min + 8 * scale.
                q = unpack_int4(self.qweight).to(torch.int32)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                zeros = self.mins + 8 * self.scales
                scales_and_zeros = torch.stack([self.scales.t(), zeros.t()], dim=-1).contiguous()
                del self.mins
                self.register_buffer("qweight", packed)
                self.register_buffer("scales", scales_and_zeros)
            # The CPU kernels take bfloat16 activations and scales (see forward).
            self.scales = self.scales.to(torch.bfloat16)
            self.kernel = "cpu"
        elif device.type == "cuda":
            import importlib.util

            if importlib.util.find_spec("triton") is None:
                raise ConfigError(
                    f"{self.format} weights on a GPU need the triton package (pip install triton)"
                )
            self.kernel = "triton"
            from swarmkv.kernels.quant_gemv import compute_units  # imports triton: only on a GPU

            self.num_sms = compute_units(device)
        else:
            raise ConfigError(f"{self.format} weights run on the CPU or a CUDA/ROCm GPU, not {device.type!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None, "QuantizedLinear.finalize() was not called"
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "cpu":
            # PyTorch's CPU kernels are fast with bfloat16 activations (about 2x float32's linear at decode)
            # and over 10x slower with float32 ones; the output returns to the model's dtype.
            activations = flat.to(torch.bfloat16)
            if self.format == "int8":
                out = torch.ops.aten._weight_int8pack_mm(activations, self.qweight, self.scales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    activations, self.qweight, INT4_GROUP_SIZE, self.scales
                )
            out = out.to(flat.dtype)
        else:
            from swarmkv.kernels import quant_matmul  # imports triton: only on a GPU

            if self.format == "int8":
                out = quant_matmul.int8_matmul(flat, self.qweight, self.scales, num_sms=self.num_sms)
            else:
                out = quant_matmul.int4_matmul(
                    flat, self.qweight, self.scales, self.mins, INT4_GROUP_SIZE, num_sms=self.num_sms
                )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


def make_linear(in_features: int, out_features: int, bias: bool, fmt: WeightFormat) -> nn.Module:
    """A float nn.Linear, a QuantizedLinear of `fmt`, or a GGUFLinear (filled with the file's blocks)."""
    if fmt == "float":
        return nn.Linear(in_features, out_features, bias=bias)
    if fmt == "gguf":
        from swarmkv.models.gguf_linear import GGUFLinear

        return GGUFLinear(in_features, out_features, bias)
    return QuantizedLinear(in_features, out_features, fmt, bias)


def finalize_quantized(model: nn.Module) -> None:
    """Fit every quantized layer of a loaded model to its device's kernel."""
    from swarmkv.models.gguf_linear import GGUFLinear

    for module in model.modules():
        if isinstance(module, QuantizedLinear | GGUFLinear):
            module.finalize()
