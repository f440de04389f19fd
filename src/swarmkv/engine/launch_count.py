"""Counting a step's device operations: Triton kernel launches plus the torch ops that launch a kernel
(matmuls, copies, elementwise ops, fills), attributed to the decoder layer that issued them. It works on a
GPU and on the CPU under TRITON_INTERPRET=1 alike, because it counts calls, not time. Count an eager step
(`enforce_eager`): a replayed CUDA graph runs no Python, so the counter sees none of its launches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that only allocate or describe memory: no kernel runs for them.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::lift_fresh",
    "aten::detach_",
    "aten::_unsafe_view",
    "aten::is_pinned",
    "aten::_pin_memory",
    "aten::pin_memory",
}


@dataclass
class Launches:
    """The device operations one region ran, in order, and where each decoder layer's began and ended."""

    names: list[str] = field(default_factory=list)
    layer_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) into `names`

    def per_layer(self) -> list[int]:
        """Operations each layer issued, in the order the layers ran."""
        return [end - start for start, end in self.layer_spans]

    def layer_names(self, index: int) -> list[str]:
        """The names of the operations layer run `index` issued."""
        start, end = self.layer_spans[index]
        return self.names[start:end]


class _TorchOps(TorchDispatchMode):
    """Records every aten op that launches a kernel, except while a Triton launch runs (the interpreter's
    own host copies are part of that one launch)."""

    def __init__(self, launches: Launches, device: torch.device | None) -> None:
        super().__init__()
        self.launches = launches
        self.device = device
        self.inside_triton = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.inside_triton and _is_composite(func):
            # Under inference_mode a composite op (reshape, linear) reaches the mode whole: run its
            # decomposition under the mode, so a reshape that copies shows its copy.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        name = func._schema.name
        if (
            not self.inside_triton
            and not func.is_view
            and name not in _NO_KERNEL
            and self._on_device(args, out)
        ):
            self.launches.names.append(name)
        return out

    def _on_device(self, args: tuple[Any, ...], out: Any) -> bool:
        if self.device is None:
            return True
        tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
        return any(t.device.type == self.device.type for t in tensors)


def _is_composite(func: Any) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


@contextmanager
def _triton_launches(record: Callable[[str], None], mode: _TorchOps) -> Iterator[None]:
    """Route every Triton launch (compiled or interpreted) through `record` for the duration."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("warmup"):
                return run(self, *args, **kwargs)
            record(f"triton::{self.fn.__name__}")
            outer, mode.inside_triton = mode.inside_triton, True
            try:
                return run(self, *args, **kwargs)
            finally:
                mode.inside_triton = outer

        counted.counting = True  # type: ignore[attr-defined]
        return counted

    for cls, run in originals.items():
        cls.run = wrap(run)
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


@contextmanager
def count_launches(model: nn.Module | None = None, device: torch.device | None = None) -> Iterator[Launches]:
    """Record the device operations run inside the block; with `model`, also where each module of its
    `layers` list began and ended; with `device`, only torch ops touching a tensor there count (a GPU step's
    host-side metadata work does not). Refuses nesting: the hooks it installs are process-wide."""
    from triton.runtime.jit import JITFunction

    assert not hasattr(JITFunction.run, "counting"), "count_launches does not nest"
    launches = Launches()
    handles = []
    if model is not None:
        starts: list[int] = []

        def before(module: nn.Module, args: Any) -> None:
            starts.append(len(launches.names))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            launches.layer_spans.append((starts.pop(), len(launches.names)))

        for layer in model.layers:  # type: ignore[union-attr]
            handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    mode = _TorchOps(launches, device)
    try:
        with mode, _triton_launches(launches.names.append, mode):
            yield launches
    finally:
        for handle in handles:
            handle.remove()


def launches_per_layer(
    model: nn.Module, step: Callable[[], object], device: torch.device | None = None
) -> tuple[list[int], Launches]:
    """Run `step` once under count_launches: the operations each of `model`'s layers issued, and the record."""
    with torch.no_grad(), count_launches(model, device) as launches:
        step()
    return launches.per_layer(), launches
