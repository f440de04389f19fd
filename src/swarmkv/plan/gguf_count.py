"""A GGUF file's weights as swarmkv holds them, counted tensor by tensor from the file's tensor infos (no tensor
data read) through `models.gguf_held`, the rule the loader follows, and summed per GGUF type."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType

from swarmkv.models.gguf_held import (
    held_kind,
    is_converted,
    is_held,
    nextn_first_block,
    tensor_held_bytes,
)

EMBEDDING, LM_HEAD = "token_embd.weight", "output.weight"


@dataclass(frozen=True)
class TensorCount:
    """One tensor of the file: its type and GGUF shape (ne0 first), its bytes in the file and as held."""

    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    file_bytes: int
    held_as: str  # the kind's name, or the float dtype's
    held_bytes: int  # 0 when not held
    held: bool  # False for the NextN / MTP head's tensors, which swarmkv does not run
    converted: bool  # neither float nor a type the layout keeps: converted at load


@dataclass(frozen=True)
class TypeRow:
    """The tensors of one GGUF type, summed."""

    kind: str
    tensors: int
    file_bytes: int
    held_bytes: int
    held_as: str  # what they are held as ("Q4_K", "float16", "Q8_0 (converted)", mixed with " / ")

    @property
    def ratio(self) -> float:
        """Held bytes over file bytes."""
        return self.held_bytes / self.file_bytes if self.file_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        """The row as the `--json` output writes it."""
        return {
            "type": self.kind,
            "tensors": self.tensors,
            "file_bytes": self.file_bytes,
            "held_bytes": self.held_bytes,
            "held_as": self.held_as,
            "held_over_file": self.ratio,
        }


@dataclass(frozen=True)
class GGUFWeightCount:
    """Every tensor of a GGUF file as swarmkv holds it, floats at `float_dtype`."""

    tensors: tuple[TensorCount, ...]
    float_dtype: str
    tied_embeddings: bool  # no output.weight: the embedding is held once and serves as the LM head

    @property
    def held(self) -> list[TensorCount]:
        """The tensors the loader holds."""
        return [t for t in self.tensors if t.held]

    @property
    def skipped(self) -> list[TensorCount]:
        """The NextN / MTP head's tensors, in the file and not held."""
        return [t for t in self.tensors if not t.held]

    @property
    def converted(self) -> list[TensorCount]:
        """Held tensors whose type the loader converts (to Q8_0, or to float where Q8_0 cannot hold them)."""
        return [t for t in self.held if t.converted]

    @property
    def total_bytes(self) -> int:
        """Everything held."""
        return sum(t.held_bytes for t in self.tensors)

    @property
    def file_tensor_bytes(self) -> int:
        """Every tensor's bytes in the file, held or not."""
        return sum(t.file_bytes for t in self.tensors)

    @property
    def held_file_bytes(self) -> int:
        """The file bytes of the tensors that are held."""
        return sum(t.file_bytes for t in self.held)

    def rows(self) -> list[TypeRow]:
        """One row per GGUF type of the held tensors, the most file bytes first."""
        groups: dict[str, list[TensorCount]] = {}
        for tensor in self.held:
            groups.setdefault(tensor.kind.name, []).append(tensor)
        rows = [
            TypeRow(
                kind,
                len(group),
                sum(t.file_bytes for t in group),
                sum(t.held_bytes for t in group),
                " / ".join(dict.fromkeys(t.held_as for t in group)),
            )
            for kind, group in groups.items()
        ]
        return sorted(rows, key=lambda r: (-r.file_bytes, r.kind))

    def to_json(self) -> dict[str, Any]:
        """The count as the `--json` output writes it."""
        return {
            "float_dtype": self.float_dtype,
            "tied_embeddings": self.tied_embeddings,
            "tensors": len(self.held),
            "held_bytes": self.total_bytes,
            "file_tensor_bytes": self.file_tensor_bytes,
            "held_file_bytes": self.held_file_bytes,
            "held_over_file": self.total_bytes / self.held_file_bytes if self.held_file_bytes else 0.0,
            "types": [row.to_json() for row in self.rows()],
            "converted": [
                {"name": t.name, "type": t.kind.name, "held_as": t.held_as} for t in self.converted
            ],
            "skipped": {
                "tensors": len(self.skipped),
                "file_bytes": sum(t.file_bytes for t in self.skipped),
                "why": "the NextN / MTP head (multi-token prediction), which swarmkv does not run",
            },
        }


def count_tensor(
    name: str,
    kind: GGMLQuantizationType,
    shape: tuple[int, ...],
    file_bytes: int,
    float_dtype: torch.dtype,
    held: bool,
) -> TensorCount:
    """One tensor through the loader's rule."""
    as_kind = held_kind(kind, shape)
    converted = is_converted(kind)
    dtype_name = str(float_dtype).removeprefix("torch.")
    held_as = dtype_name if as_kind == "float" else as_kind.name
    return TensorCount(
        name,
        kind,
        shape,
        file_bytes,
        held_as + (" (converted)" if converted else ""),
        tensor_held_bytes(kind, shape, float_dtype) if held else 0,
        held,
        converted,
    )


def count_gguf_tensors(
    infos: Iterable[tuple[str, GGMLQuantizationType, tuple[int, ...], int]],
    metadata: Mapping[str, Any],
    float_dtype: torch.dtype,
    mtp: bool = False,
) -> GGUFWeightCount:
    """Tensor infos (name, type, GGUF shape, file bytes) of a file with this metadata -> what swarmkv holds
    (`mtp`: the multi-token-prediction layer's tensors too, as the engine holds them to draft)."""
    arch = str(metadata.get("general.architecture", ""))
    skip_from = None if mtp else nextn_first_block(metadata, arch)
    tensors = tuple(
        count_tensor(name, kind, shape, nbytes, float_dtype, is_held(name, skip_from))
        for name, kind, shape, nbytes in infos
    )
    names = {t.name for t in tensors}
    return GGUFWeightCount(tensors, str(float_dtype).removeprefix("torch."), LM_HEAD not in names)


def count_gguf_weights(
    reader: Any, metadata: Mapping[str, Any], float_dtype: torch.dtype, mtp: bool = False
) -> GGUFWeightCount:
    """A `gguf.GGUFReader`'s tensors (their infos only) -> what swarmkv holds (`mtp`: as `count_gguf_tensors`)."""
    infos = [
        (
            t.name,
            GGMLQuantizationType(int(t.tensor_type)),
            tuple(int(d) for d in t.shape.tolist()),
            int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    return count_gguf_tensors(infos, metadata, float_dtype, mtp)
