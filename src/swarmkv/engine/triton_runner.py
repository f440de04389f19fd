"""The triton backend's half of the runner: a step's metadata in one host-to-device copy, the forward over
TritonAttention, and decode-only steps replayed from CUDA graphs."""

from __future__ import annotations

import contextlib

import torch

from swarmkv.engine.cuda_graphs import DecodeGraphs, Graph
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.scheduler import Chunk
from swarmkv.engine.triton_attention import (
    DecodeRow,
    GroupSpan,
    StepMetadata,
    TritonAttention,
    TritonShape,
    choose_splits,
    decode_tiles,
    extend_tiles,
    extend_tokens,
    max_prefix_tiles,
    pack_metadata,
    prefix_tiles,
)
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.layers import triton_ops

# Programs a decode launch aims for per compute unit: key splits make up what the batch lacks.
PROGRAMS_PER_UNIT = 4


class TritonRunner:
    """Runs steps over the triton attention backend."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        graph_buckets: list[int] | None,
        max_keys: int,
        make_graph: type[Graph] | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.page_size = kv_cache.block_size
        self.device = page_table.device
        self.num_heads = model.config.num_heads
        self.num_kv_heads = model.config.num_kv_heads
        self.head_dim = model.config.head_dim
        self.max_keys = max_keys
        self.ops = triton_ops()
        self.extend_tokens = extend_tokens(self.num_heads // self.num_kv_heads, kv_cache.dtype)
        units = torch.cuda.get_device_properties(self.device).multi_processor_count if self.is_cuda else 1
        self.target_programs = PROGRAMS_PER_UNIT * units
        self.graphs: DecodeGraphs | None = None
        if graph_buckets:
            self.graphs = DecodeGraphs(
                graph_buckets, self._graph_shape, self.forward, self.device, make_graph
            )

    @property
    def is_cuda(self) -> bool:
        """Whether the model runs on a CUDA or ROCm device."""
        return self.device.type == "cuda"

    def run(self, prefills: list[Chunk], decodes: list[Chunk], groups: list[tuple[int, int]]) -> torch.Tensor:
        """Float32 logits of the sampling chunks, in row order (prefills, then decodes as ordered)."""
        # Triton launches on the thread's current device, and the engine may run on its own thread.
        with torch.cuda.device(self.device) if self.is_cuda else contextlib.nullcontext():
            return self._run(prefills, decodes, groups)

    def _run(
        self, prefills: list[Chunk], decodes: list[Chunk], groups: list[tuple[int, int]]
    ) -> torch.Tensor:
        bucket = self.graphs.bucket(len(decodes)) if self.graphs is not None and not prefills else None
        if self.graphs is not None and bucket is not None:
            shape = self._graph_shape(bucket)
            packed = self._pack(prefills, decodes, groups, shape, logit_rows=list(range(bucket)))
            logits = self.graphs.run(bucket, packed, len(decodes))
            if logits is not None:
                return logits
        max_len = max((c.start + 1 for c in decodes), default=0)
        shape = TritonShape(
            num_tokens=sum(c.num_tokens for c in prefills) + len(decodes),
            num_extend_tiles=sum(-(-c.num_tokens // self.extend_tokens) for c in prefills),
            num_prefix_tiles=len(prefix_tiles(self._group_spans(decodes, groups), 0)),
            num_decodes=len(decodes),
            num_logits=sum(c.samples for c in prefills + decodes),
            num_splits=choose_splits(len(decodes), self.num_kv_heads, max_len, self.target_programs),
        )
        packed = self._pack(prefills, decodes, groups, shape, logit_rows=None)
        return self.forward(StepMetadata(packed.to(self.device, non_blocking=True), shape))

    def forward(self, meta: StepMetadata) -> torch.Tensor:
        """The model over one step's device metadata: float32 logits of its logit rows."""
        attention = TritonAttention(
            self.kv_cache, self.page_table.table, meta, self.num_heads, self.head_dim, self.extend_tokens
        )
        hidden = self.model(meta.input_ids, meta.positions, attention, self.ops)
        return self.model.compute_logits(hidden[meta.logit_rows])

    def _graph_shape(self, bucket: int) -> TritonShape:
        # Splits are fixed per graph, so they are sized for the longest context the engine allows.
        splits = choose_splits(bucket, self.num_kv_heads, self.max_keys, self.target_programs)
        return TritonShape(bucket, 0, max_prefix_tiles(bucket), bucket, bucket, splits)

    def _group_spans(self, decodes: list[Chunk], groups: list[tuple[int, int]]) -> list[GroupSpan]:
        spans, first = [], 0
        for size, num_pages in groups:
            row = self.page_table.row(decodes[first].request_id)
            spans.append(GroupSpan(first, size, row, num_pages * self.page_size))
            first += size
        return spans

    def _pack(
        self,
        prefills: list[Chunk],
        decodes: list[Chunk],
        groups: list[tuple[int, int]],
        shape: TritonShape,
        logit_rows: list[int] | None,
    ) -> torch.Tensor:
        """The step's metadata in one host buffer (pinned on a GPU, so its copy does not wait)."""
        table, size = self.page_table, self.page_size
        ordered = prefills + decodes
        token_ids = [t for c in ordered for t in c.token_ids]
        positions = [p for c in ordered for p in range(c.start, c.start + c.num_tokens)]
        rows = [table.row(c.request_id) for c in ordered]
        token_rows = torch.tensor(
            [r for c, r in zip(ordered, rows, strict=True) for _ in range(c.num_tokens)]
        )
        pos = torch.tensor(positions, dtype=torch.int64)
        slots = (table.host[token_rows, pos // size] * size + pos % size).tolist() if positions else []
        extend, q_start = [], 0
        for chunk, row in zip(prefills, rows, strict=False):
            extend += extend_tiles(q_start, chunk.num_tokens, row, chunk.start, self.extend_tokens)
            q_start += chunk.num_tokens
        spans = self._group_spans(decodes, groups)
        shared = [0] * len(decodes)
        for g in spans:
            shared[g.first : g.first + g.size] = [g.shared_tokens] * g.size
        decode_rows = [
            DecodeRow(c.start, row, s)
            for c, row, s in zip(decodes, rows[len(prefills) :], shared, strict=True)
        ]
        if logit_rows is None:
            ends, row_end = [], 0
            for chunk in ordered:
                row_end += chunk.num_tokens
                if chunk.samples:
                    ends.append(row_end - 1)
            logit_rows = ends
        # In a padded (graph) shape the decodes start after the padding of the token sections.
        decode_row0 = shape.num_tokens - shape.num_decodes
        assert decode_row0 == q_start or not decodes, "a graph step has no prefill rows"
        packed = pack_metadata(
            shape,
            token_ids,
            positions,
            slots,
            extend,
            prefix_tiles(spans, decode_row0),
            decode_tiles(decode_rows, decode_row0, shape.decode_column),
            logit_rows,
        )
        return packed.pin_memory() if self.is_cuda else packed
