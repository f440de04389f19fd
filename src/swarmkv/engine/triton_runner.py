"""The triton backend's half of the runner: a step's metadata in one host-to-device copy, the forward over
TritonAttention (and, for a hybrid, its state slots), and decode-only steps replayed from CUDA graphs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmkv.core.scheduler import Chunk, sampling_rows
from swarmkv.engine.cuda_graphs import DecodeGraphs, Graph
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.lookahead import ProvisionalInputs
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.state_cache import StateCache
from swarmkv.engine.triton_attention import (
    DecodeRow,
    GroupSpan,
    StepMetadata,
    Tile,
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
from swarmkv.engine.triton_recurrent import TritonRecurrentStep
from swarmkv.kernels.quant_gemv import compute_units
from swarmkv.models.attention import AttentionBackend
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.layers import triton_ops

# Programs a decode launch aims for per compute unit: key splits make up what the batch lacks.
PROGRAMS_PER_UNIT = 4
# Mixed-step graphs: the prefill tokens a graph holds (buckets), and its prefill chunks at most. A step with
# more runs eagerly: its prefill's work dwarfs the launches a graph would save.
MIXED_TOKEN_BUCKETS = (16, 32, 64, 128, 256)
MIXED_MAX_CHUNKS = 4


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
        states: StateCache | None = None,
        mixed_graphs: bool = False,
    ) -> None:
        """A hybrid model's linear-attention layers run over `states`: each step's metadata names the slot of
        every sequence, so graph replays read and write whichever slots the step's decodes hold. With
        `mixed_graphs` (and graph buckets, and no states), steps with prefill chunks are graphed too."""
        self.model = model
        self.states = states
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
        # fla's chunked kernels for prefill chunks where they run (a GPU, with the `gpu` extra installed); the
        # recurrent kernel (exact, serial over a chunk's tokens) elsewhere and under the interpreter.
        self.chunked_prefill = self.is_cuda and importlib.util.find_spec("fla") is not None
        units = compute_units(self.device)  # 1 off a GPU
        self.target_programs = PROGRAMS_PER_UNIT * units
        self.graphs: DecodeGraphs | None = None
        # Mixed steps' graphs by prefill-token bucket, each over the decode buckets.
        self.mixed_graphs: dict[int, DecodeGraphs] = {}
        if graph_buckets:
            self.graphs = DecodeGraphs(
                graph_buckets, self._graph_shape, self.forward, self.device, make_graph
            )
            if mixed_graphs and states is None:
                self.mixed_graphs = {
                    tokens: DecodeGraphs(
                        graph_buckets,
                        functools.partial(self._mixed_shape, tokens),
                        self.forward,
                        self.device,
                        make_graph,
                    )
                    for tokens in MIXED_TOKEN_BUCKETS
                }

    @property
    def is_cuda(self) -> bool:
        """Whether the model runs on a CUDA or ROCm device."""
        return self.device.type == "cuda"

    def run(
        self,
        prefills: list[Chunk],
        decodes: list[Chunk],
        groups: list[tuple[int, int]],
        state_slots: dict[str, int] | None = None,
        provisional: ProvisionalInputs | None = None,
    ) -> torch.Tensor:
        """Float32 logits of the sampling chunks, in row order (prefills, then decodes as ordered);
        `state_slots`: a hybrid's state slot of each chunk's request; `provisional`: where the decodes whose
        last token is provisional read their input ids, on the device."""
        # Triton launches on the thread's current device, and the engine may run on its own thread.
        with torch.cuda.device(self.device) if self.is_cuda else contextlib.nullcontext():
            return self._run(prefills, decodes, groups, state_slots or {}, provisional)

    def _run(
        self,
        prefills: list[Chunk],
        decodes: list[Chunk],
        groups: list[tuple[int, int]],
        state_slots: dict[str, int],
        provisional: ProvisionalInputs | None,
    ) -> torch.Tensor:
        step = self._describe(prefills, decodes, groups, state_slots)

        def fill(input_ids: torch.Tensor, gap: int = 0) -> None:
            """The provisional inputs, in a layout with `gap` padding rows after the prefill tokens."""
            if provisional is not None:
                num_prefill = len(step.token_ids) - len(decodes)
                rows, picks = provisional.rows(prefills + decodes)
                provisional.fill_rows(input_ids, [r + gap if r >= num_prefill else r for r in rows], picks)

        if not any(c.draft for c in prefills):
            logits = self._replay(step, len(prefills), len(decodes), fill)
            if logits is not None:
                return logits
        max_len = max((d.position + 1 for d in step.decodes), default=0)
        shape = TritonShape(
            num_tokens=len(step.token_ids),
            num_extend_tiles=len(step.extend_tiles),
            num_prefix_tiles=len(step.prefix_tiles),
            num_decodes=len(step.decodes),
            num_logits=len(step.logit_rows),
            num_splits=choose_splits(len(decodes), self.num_kv_heads, max_len, self.target_programs),
            num_state_seqs=len(step.state_slots),
        )
        packed = self._pack(step, shape, step.logit_rows)
        meta = StepMetadata(packed.to(self.device, non_blocking=True), shape)
        fill(meta.input_ids)
        # Speculative chunks follow the plain prefill chunks (ModelRunner.run orders them so).
        speculative = [c for c in prefills if c.draft]
        assert all(c.draft for c in prefills[len(prefills) - len(speculative) :])
        speculative_slots = (
            tuple(state_slots[c.request_id] for c in speculative) if self.states is not None else ()
        )
        return self.forward(meta, tuple(c.num_tokens for c in prefills), speculative_slots)

    def _replay(
        self,
        step: _HostStep,
        num_prefills: int,
        num_decodes: int,
        fill: Callable[[torch.Tensor, int], None],
    ) -> torch.Tensor | None:
        """The step's logits replayed from its bucket's graph, or None where no graph holds it (run it
        eagerly). A mixed step is padded to its prefill-token bucket between its prefill rows and its decodes,
        so its decodes start where the graph's do."""
        num_prefill = len(step.token_ids) - num_decodes
        graphs, gap = self.graphs, 0
        if num_prefills:
            tokens = next((t for t in sorted(self.mixed_graphs) if t >= num_prefill), None)
            if tokens is None or num_prefills > MIXED_MAX_CHUNKS:
                return None
            graphs, gap = self.mixed_graphs[tokens], tokens - num_prefill
            step = _with_gap(step, num_prefill, gap)
        bucket = graphs.bucket(num_decodes) if graphs is not None else None
        if graphs is None or bucket is None:
            return None
        logit_rows = step.logit_rows if num_prefills else list(range(bucket))
        packed = self._pack(step, graphs.shape_for(bucket), logit_rows)
        return graphs.run(bucket, packed, len(step.logit_rows), lambda ids: fill(ids, gap))

    def _mixed_shape(self, prefill_tokens: int, bucket: int) -> TritonShape:
        """A mixed step's graph shape: `prefill_tokens` rows of at most MIXED_MAX_CHUNKS chunks, then a
        decode bucket's."""
        decode = self._graph_shape(bucket)
        return dataclasses.replace(
            decode,
            num_tokens=prefill_tokens + bucket,
            num_extend_tiles=-(-prefill_tokens // self.extend_tokens) + MIXED_MAX_CHUNKS,
            num_logits=bucket + MIXED_MAX_CHUNKS,
        )

    def forward(
        self,
        meta: StepMetadata,
        prefill_tokens: tuple[int, ...] = (),
        speculative_slots: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """The model over one step's device metadata: float32 logits of its logit rows. `prefill_tokens`:
        the lengths of its prefill chunks (none in a graph), which a hybrid's chunked kernels take;
        `speculative_slots`: a hybrid's state slots of its speculative chunks, the last prefill chunks."""
        attention = TritonAttention(
            self.kv_cache, self.page_table.table, meta, self.num_heads, self.head_dim, self.extend_tokens
        )
        backend: AttentionBackend = attention
        if self.states is not None:
            backend = TritonRecurrentStep(
                attention, self.states, meta, prefill_tokens, self.chunked_prefill, speculative_slots
            )
        hidden = self.model(meta.input_ids, meta.positions, backend, self.ops)
        return self.model.compute_logits(hidden[meta.logit_rows])

    def _graph_shape(self, bucket: int) -> TritonShape:
        # Splits are fixed per graph, so they are sized for the longest context the engine allows.
        splits = choose_splits(bucket, self.num_kv_heads, self.max_keys, self.target_programs)
        state_seqs = bucket if self.states is not None else 0
        return TritonShape(bucket, 0, max_prefix_tiles(bucket), bucket, bucket, splits, state_seqs)

    def _describe(
        self,
        prefills: list[Chunk],
        decodes: list[Chunk],
        groups: list[tuple[int, int]],
        state_slots: dict[str, int],
    ) -> _HostStep:
        """Everything a step's metadata holds, built once on the host from its chunks and page tables."""
        table, size = self.page_table, self.page_size
        ordered = prefills + decodes
        rows = [table.row(c.request_id) for c in ordered]
        counts = torch.tensor([c.num_tokens for c in ordered])
        positions = torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in ordered])
        token_rows = torch.repeat_interleave(torch.tensor(rows), counts)
        slots = table.host[token_rows, positions // size] * size + positions % size
        extend, q_start = [], 0
        for chunk, row in zip(prefills, rows, strict=False):
            extend += extend_tiles(q_start, chunk.num_tokens, row, chunk.start, self.extend_tokens)
            q_start += chunk.num_tokens
        spans, first = [], 0
        shared = [0] * len(decodes)
        for members, num_pages in groups:
            span = GroupSpan(first, members, rows[len(prefills) + first], num_pages * size)  # rows: per chunk
            shared[first : first + members] = [span.shared_tokens] * members
            spans.append(span)
            first += members
        decode_rows = [
            DecodeRow(c.start, row, s)
            for c, row, s in zip(decodes, rows[len(prefills) :], shared, strict=True)
        ]
        return _HostStep(
            token_ids=[t for c in ordered for t in c.token_ids],
            positions=positions,
            slots=slots,
            extend_tiles=extend,
            prefix_tiles=prefix_tiles(spans, q_start),  # decodes follow the prefill rows (none in a graph)
            decodes=decode_rows,
            logit_rows=sampling_rows(ordered),
            chunk_tokens=[c.num_tokens for c in ordered],
            state_slots=[state_slots[c.request_id] for c in ordered] if self.states is not None else [],
        )

    def _pack(self, step: _HostStep, shape: TritonShape, logit_rows: list[int]) -> torch.Tensor:
        """The step's metadata in one host buffer (pinned on a GPU, so its copy does not wait)."""
        decode_row0 = len(step.token_ids) - len(step.decodes)
        state_starts: list[int] = []
        if shape.num_state_seqs:
            # Each sequence's first row, then the end; a graph's padding sequences are its padding rows.
            state_starts = [0]
            for num_tokens in step.chunk_tokens:
                state_starts.append(state_starts[-1] + num_tokens)
            padding = shape.num_state_seqs - len(step.chunk_tokens)
            state_starts += range(state_starts[-1] + 1, state_starts[-1] + 1 + padding)
        packed = pack_metadata(
            shape,
            step.token_ids,
            step.positions,
            step.slots,
            step.extend_tiles,
            step.prefix_tiles,
            decode_tiles(step.decodes, decode_row0, shape.decode_column),
            logit_rows,
            state_starts,
            step.state_slots,
        )
        return packed.pin_memory() if self.is_cuda else packed


@dataclass(frozen=True)
class _HostStep:
    """One step's metadata on the host, before it is laid out for an eager or a graph shape."""

    token_ids: list[int]
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    extend_tiles: list[Tile]
    prefix_tiles: list[Tile]
    decodes: list[DecodeRow]
    logit_rows: list[int]
    chunk_tokens: list[int]  # rows per chunk, prefills then decodes
    state_slots: list[int]  # a hybrid's state slot per chunk; empty for a dense model


def _with_gap(step: _HostStep, num_prefill: int, gap: int) -> _HostStep:
    """`step` with `gap` padding rows (no KV stored, no logits read) between its prefill tokens and its
    decodes: the layout of a mixed graph, whose decodes start at its prefill-token bucket."""
    before, after = slice(None, num_prefill), slice(num_prefill, None)
    return dataclasses.replace(
        step,
        token_ids=step.token_ids[before] + [0] * gap + step.token_ids[after],
        positions=torch.cat(
            [step.positions[before], torch.zeros(gap, dtype=torch.int64), step.positions[after]]
        ),
        slots=torch.cat([step.slots[before], torch.full((gap,), -1, dtype=torch.int64), step.slots[after]]),
        prefix_tiles=[(t[0] + gap, *t[1:]) for t in step.prefix_tiles],
        logit_rows=[r + gap if r >= num_prefill else r for r in step.logit_rows],
    )
