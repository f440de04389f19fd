"""The triton attention backend: a step's metadata built on the host, copied to the device once, and read by
the kernels of `swarmkv.kernels.attention` for every layer.

Rows of the flat batch: prefill chunks first, then decodes, grouped decodes first and contiguous per group.
Decode rows attend in `num_splits` key splits; a grouped decode's partials sit in columns
[num_splits, 2 * num_splits) beside its group's shared-prefix partials in [0, num_splits), and one merge per
layer combines them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from swarmkv.engine.kv_cache import KVCache
from swarmkv.kernels.attention import (
    BLOCK_N,
    MAX_COLUMNS,
    NOT_CAUSAL,
    TILE_FIELDS,
    attend_tiles,
    merge_partials,
    store_kv,
    tile_tokens,
)
from swarmkv.models.attention import KVSlabs

# q_start, q_count, table_row, kv_start, kv_end, q_pos0, column: see swarmkv.kernels.attention
Tile = tuple[int, int, int, int, int, int, int]

PREFIX_TOKENS = 16  # grouped decodes per shared-prefix tile: the prefix is read once per tile
MAX_SPLITS = MAX_COLUMNS // 2  # the shared prefix's splits and the own keys' splits share the merge


def extend_tokens(group: int, dtype: torch.dtype) -> int:
    """Prefill tokens per tile: 128 rows of (token, head) for half types, 64 for float32 (its tiles take
    twice the shared memory); more tokens per tile means fewer re-reads of each key block."""
    rows = 64 if dtype == torch.float32 else 128
    return tile_tokens(group, max(1, rows // triton.next_power_of_2(group)))


@dataclass(frozen=True)
class DecodeRow:
    """One decode: its token's position, its page-table row, and how many of its first tokens it reads
    through its group's shared-prefix tiles instead (0 outside a group)."""

    position: int
    table_row: int
    shared_tokens: int


@dataclass(frozen=True)
class GroupSpan:
    """A cascade group: decode rows [first, first + size) (counted among decodes) over the leader's row."""

    first: int
    size: int
    table_row: int
    shared_tokens: int


@dataclass(frozen=True)
class TritonShape:
    """The sizes a step's metadata is laid out for: exact for an eager step, a bucket's for a graph."""

    num_tokens: int
    num_extend_tiles: int
    num_prefix_tiles: int
    num_decodes: int
    num_logits: int
    num_splits: int
    # A hybrid's sequences (prefill chunks, then decodes), each continuing a state slot; 0 for a dense model.
    num_state_seqs: int = 0

    @property
    def decode_column(self) -> int:
        """The first partial column of the decodes' own keys (the shared prefix's columns come first)."""
        return self.num_splits if self.num_prefix_tiles else 0

    @property
    def num_columns(self) -> int:
        """Partial columns per decode row."""
        return self.decode_column + self.num_splits

    def section_sizes(self) -> dict[str, int]:
        """Int64 elements of each section of the packed metadata, in packing order."""
        return {
            "input_ids": self.num_tokens,
            "positions": self.num_tokens,
            "slot_mapping": self.num_tokens,
            "extend_tiles": self.num_extend_tiles * TILE_FIELDS,
            "prefix_tiles": self.num_prefix_tiles * TILE_FIELDS,
            "decode_tiles": self.num_decodes * TILE_FIELDS,
            "logit_rows": self.num_logits,
            "state_starts": self.num_state_seqs + 1 if self.num_state_seqs else 0,
            "state_slots": self.num_state_seqs,
        }


class StepMetadata:
    """Views of one packed int64 buffer on the device, one per section of a TritonShape."""

    def __init__(self, packed: torch.Tensor, shape: TritonShape) -> None:
        self.packed = packed
        self.shape = shape
        views, offset = {}, 0
        for name, size in shape.section_sizes().items():
            views[name] = packed[offset : offset + size]
            offset += size
        self.input_ids = views["input_ids"]
        self.positions = views["positions"]
        self.slot_mapping = views["slot_mapping"]
        self.extend_tiles = views["extend_tiles"].view(-1, TILE_FIELDS)
        self.prefix_tiles = views["prefix_tiles"].view(-1, TILE_FIELDS)
        self.decode_tiles = views["decode_tiles"].view(-1, TILE_FIELDS)
        self.logit_rows = views["logit_rows"]
        self.state_starts = views["state_starts"]  # sequence n holds rows [starts[n], starts[n + 1])
        self.state_slots = views["state_slots"]

    @property
    def decode_row0(self) -> int:
        """The flat-batch row of the first decode."""
        return self.shape.num_tokens - self.shape.num_decodes


def pack_metadata(
    shape: TritonShape,
    token_ids: list[int],
    positions: torch.Tensor | list[int],
    slot_mapping: torch.Tensor | list[int],
    extend_tiles: list[Tile],
    prefix_tiles: list[Tile],
    decode_tiles: list[Tile],
    logit_rows: list[int],
    state_starts: list[int] | None = None,
    state_slots: list[int] | None = None,
) -> torch.Tensor:
    """One host int64 buffer laid out as `shape` says; sections shorter than their size are padded (ids
    and positions with 0, KV and state slots with -1 so padding rows store nothing, tiles with empty
    tiles)."""
    sizes = shape.section_sizes()
    packed = torch.zeros(sum(sizes.values()), dtype=torch.int64)
    offset = 0
    sections: dict[str, torch.Tensor | list[int] | list[Tile]] = {
        "input_ids": token_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "extend_tiles": extend_tiles,
        "prefix_tiles": prefix_tiles,
        "decode_tiles": decode_tiles,
        "logit_rows": logit_rows,
        "state_starts": state_starts or [],
        "state_slots": state_slots or [],
    }
    for name, size in sizes.items():
        values = torch.as_tensor(sections[name], dtype=torch.int64).reshape(-1)  # tiles flatten to fields
        assert len(values) <= size, f"{name}: {len(values)} values for {size} places"
        if name in ("slot_mapping", "state_slots"):
            packed[offset : offset + size] = -1
        packed[offset : offset + len(values)] = values
        offset += size
    return packed


def extend_tiles(
    q_start: int, num_tokens: int, table_row: int, first_position: int, tokens_per_tile: int
) -> list[Tile]:
    """Tiles of one prefill chunk: causal over its row up to its last token."""
    end = first_position + num_tokens
    return [
        (q_start + off, min(tokens_per_tile, num_tokens - off), table_row, 0, end, first_position + off, -1)
        for off in range(0, num_tokens, tokens_per_tile)
    ]


def prefix_tiles(groups: list[GroupSpan], decode_row0: int) -> list[Tile]:
    """Tiles of the groups' shared prefixes: members' tokens, not causal, over the leader's row."""
    tiles: list[Tile] = []
    for g in groups:
        for off in range(0, g.size, PREFIX_TOKENS):
            count = min(PREFIX_TOKENS, g.size - off)
            tiles.append((decode_row0 + g.first + off, count, g.table_row, 0, g.shared_tokens, NOT_CAUSAL, 0))
    return tiles


def decode_tiles(decodes: list[DecodeRow], decode_row0: int, column: int) -> list[Tile]:
    """One tile per decode: its token over its own keys past the shared prefix."""
    return [
        (decode_row0 + i, 1, d.table_row, d.shared_tokens, d.position + 1, d.position, column)
        for i, d in enumerate(decodes)
    ]


def max_prefix_tiles(num_decodes: int) -> int:
    """The most shared-prefix tiles `num_decodes` decodes can need (groups have two members or more)."""
    return 0 if num_decodes < 2 else num_decodes // 2 + -(-num_decodes // PREFIX_TOKENS)


def choose_splits(num_decodes: int, num_kv_heads: int, max_keys: int, target_programs: int) -> int:
    """Key splits per decode: enough programs to fill the device, no split shorter than a key block."""
    wanted = -(-target_programs // max(1, num_decodes * num_kv_heads))
    return max(1, min(MAX_SPLITS, wanted, -(-max_keys // BLOCK_N)))


class TritonAttention:
    """An AttentionBackend over one step's StepMetadata: store, extend, shared-prefix and decode, merge."""

    def __init__(
        self,
        cache: KVCache,
        table: torch.Tensor,
        meta: StepMetadata,
        num_heads: int,
        head_dim: int,
        extend_tokens: int,
    ) -> None:
        self.cache = cache
        self.extend_tokens = extend_tokens
        self.table = table
        self.meta = meta
        self.group = num_heads // cache.k.shape[2]
        shape = meta.shape
        self.partials: tuple[torch.Tensor, torch.Tensor] | None = None
        if shape.num_decodes:
            # Columns no tile writes (a prefix column of an ungrouped decode) must weigh nothing in the merge.
            dev = cache.k.device
            part_out = torch.empty(shape.num_decodes, num_heads, shape.num_columns, head_dim, device=dev)
            part_lse = torch.full(
                (shape.num_decodes, num_heads, shape.num_columns), float("-inf"), device=dev
            )
            self.partials = (part_out, part_lse)

    def kv_slabs(self, layer: int) -> KVSlabs:
        """Where `layer`'s new keys and values go: its cache slabs at the step's slots."""
        cache = self.cache
        return KVSlabs(
            cache.k[layer],
            cache.v[layer],
            self.meta.slot_mapping,
            cache.k_scales[layer],
            cache.v_scales[layer],
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v at the step's slots, then attend every row over its page-table row."""
        slabs = self.kv_slabs(layer)
        store_kv(k, v, slabs.k, slabs.v, slabs.slots, slabs.k_scale, slabs.v_scale)
        return self.attend_stored(layer, q)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attend every row over its page-table row, the step's keys and values already stored."""
        meta, shape = self.meta, self.meta.shape
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_scale, v_scale = self.cache.k_scales[layer], self.cache.v_scales[layer]
        # contiguous whatever q's strides (q may be a view of the fused QKV output)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        page_size = self.cache.block_size
        attend_tiles(
            q,
            k_cache,
            v_cache,
            self.table,
            meta.extend_tiles,
            page_size=page_size,
            tokens_per_tile=self.extend_tokens,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        if self.partials is not None:
            for tiles, tokens in ((meta.prefix_tiles, PREFIX_TOKENS), (meta.decode_tiles, 1)):
                attend_tiles(
                    q,
                    k_cache,
                    v_cache,
                    self.table,
                    tiles,
                    page_size=page_size,
                    tokens_per_tile=tile_tokens(self.group, tokens),
                    partials=self.partials,
                    part_row0=meta.decode_row0,
                    num_splits=shape.num_splits,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
            merge_partials(*self.partials, out, meta.decode_row0, shape.num_columns)
        return out
