"""Open a GGUF file once and expose its metadata as plain Python values."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from swarmkv.errors import ModelLoadError

_SCALAR_TYPES = {
    gguf.GGUFValueType.UINT8,
    gguf.GGUFValueType.INT8,
    gguf.GGUFValueType.UINT16,
    gguf.GGUFValueType.INT16,
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.UINT64,
    gguf.GGUFValueType.INT64,
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.FLOAT64,
    gguf.GGUFValueType.BOOL,
}


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: decoded metadata and the reader for its tensors."""

    path: Path
    metadata: dict[str, Any]
    reader: gguf.GGUFReader

    @property
    def architecture(self) -> str:
        """The `general.architecture` string, e.g. "llama" or "qwen3"."""
        return str(self.metadata.get("general.architecture", ""))


def _field_value(field: gguf.ReaderField) -> Any:
    kind = field.types[0] if field.types else None
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if kind in _SCALAR_TYPES:
        return field.parts[field.data[0]].tolist()[0]
    if kind == gguf.GGUFValueType.ARRAY:
        item = field.types[1] if len(field.types) > 1 else None
        if item == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [np.asarray(field.parts[i]).tolist()[0] for i in field.data]
    return None


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header; raise ModelLoadError if it is truncated or not GGUF. The last few files
    parsed are kept (keyed by path, size and modification time: a rewritten file is parsed again), so loading
    one model several times in a process (a CLI run, a test session) decodes its vocabulary once; each caller
    gets its own metadata dict."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    stat = path.stat()
    parsed = _parse(path, stat.st_size, stat.st_mtime_ns)
    return GGUFFile(path=path, metadata=dict(parsed.metadata), reader=parsed.reader)


@functools.lru_cache(maxsize=4)
def _parse(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    """The header of `path` as it is at (`size`, `mtime_ns`)."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises bare ValueError/IndexError on damaged files
        raise ModelLoadError(f"{path} is a damaged or truncated GGUF file: {exc}") from exc
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    return GGUFFile(path=path, metadata=metadata, reader=reader)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Return a GGUF file's metadata with strings decoded and arrays as lists."""
    return open_gguf(path).metadata
