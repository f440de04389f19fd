"""The report's lines for a GGUF file's weights: bytes in the file against bytes held, per GGUF type, the tensors
converted at load, and the NextN / MTP head left out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarmkv.plan.layout import Item, size, table

if TYPE_CHECKING:  # the gguf package loads only for GGUF files
    from swarmkv.plan.gguf_count import GGUFWeightCount

MAX_LISTED = 8  # converted tensors named one by one; past this, a count


def _ratio(held: int, file: int) -> str:
    return f"{held / file:.3f}" if file else "-"


def gguf_lines(count: GGUFWeightCount) -> list[str]:
    """The per-type table with its total, then what is converted and what is not held."""
    rows = count.rows()
    held, file = count.total_bytes, count.held_file_bytes
    headers = ["GGUF type", "Tensors", "File bytes", "Held bytes", "Held/file", "Held as"]
    cells = [
        [
            r.kind,
            str(r.tensors),
            f"{r.file_bytes:,}",
            f"{r.held_bytes:,}",
            _ratio(r.held_bytes, r.file_bytes),
            r.held_as,
        ]
        for r in rows
    ]
    cells.append(["total", str(len(count.held)), f"{file:,}", f"{held:,}", _ratio(held, file), ""])
    tied = "tied: the embedding is held once and serves as the LM head" if count.tied_embeddings else "untied"
    out = [
        "",
        f"Weights as swarmkv holds this GGUF, counted tensor by tensor from its header ({count.float_dtype} for"
        f" floats; LM head {tied}):",
        *table(headers, cells),
        f"Held: {held:,} bytes ({size(held)}) for {file:,} bytes of the file's tensors ({size(file)}),"
        f" {_ratio(held, file)}x.",
    ]
    converted = count.converted
    if converted:
        names = ", ".join(
            f"{t.name} ({t.kind.name} -> {t.held_as.removesuffix(' (converted)')})"
            for t in converted[:MAX_LISTED]
        )
        more = f" and {len(converted) - MAX_LISTED} more" if len(converted) > MAX_LISTED else ""
        out.append(
            f"Converted at load ({len(converted)} tensors, types the layout does not keep): {names}{more}."
        )
    skipped = count.skipped
    if skipped:
        skipped_bytes = sum(t.file_bytes for t in skipped)
        out.append(
            f"Not held: {len(skipped)} tensors ({skipped_bytes:,} bytes) of the NextN / MTP head, which swarmkv"
            f" does not run; the file's tensors total {count.file_tensor_bytes:,} bytes."
        )
    return out


def gguf_weights_items(count: GGUFWeightCount) -> list[Item]:
    """The weights' line of the fit breakdown, per GGUF type."""
    items: list[Item] = [
        (
            "weights",
            count.total_bytes,
            f"the GGUF's {len(count.held)} tensors, each at its file's bits (floats in {count.float_dtype});"
            f" the file's tensors hold {size(count.held_file_bytes)}:",
        )
    ]
    items += [
        (f"  {r.kind}", r.held_bytes, f"{r.tensors} tensor{'s' * (r.tensors != 1)}, held as {r.held_as}")
        for r in count.rows()
    ]
    return items
