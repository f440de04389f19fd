"""Decode steps replayed from CUDA graphs (HIP graphs on ROCm, through the same torch API).

A graph is captured per batch-size bucket on the bucket's first decode step: its inputs are one static
packed metadata buffer (token ids, positions, KV slots, tiles and, for a hybrid, each row's state slot) and
the resident page table, its output the static logits of every row; a hybrid's state slots are read and
written in place by the replayed kernels. A step of n decodes is padded to the smallest bucket that holds
it: padding rows store no KV, have no state slot (-1), attend to nothing and their logits are ignored. Steps with
prefill chunks run eagerly unless mixed-step graphs are on (`TritonRunner`: one `DecodeGraphs` per prefill-token
bucket, dense models); so do steps with more decodes than the largest bucket, and a bucket's steps after its
capture failed (out of memory, say).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from swarmkv.engine.triton_attention import StepMetadata, TritonShape

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below `max_num_seqs`, then `max_num_seqs` itself: 1, 2, 4, 8, ..., max."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return [*buckets, max_num_seqs]


class Graph(Protocol):
    """Something that records a computation once and replays it on the same buffers."""

    def capture(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `compute`; return its output tensor, which every replay rewrites in place."""
        ...

    def replay(self) -> None:
        """Run the recorded computation again on the current contents of its input buffers."""
        ...


class CudaGraph:
    """A torch.cuda.CUDAGraph whose captures share one memory pool (replays never overlap)."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Warm up once outside the graph (kernels compile there), then capture."""
        compute()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = compute()
        return out

    def replay(self) -> None:
        """Launch the captured kernels."""
        self.graph.replay()


class EagerGraph:
    """A stand-in for CudaGraph that recomputes on replay: lets the CPU suite test padding and buckets."""

    def __init__(self) -> None:
        self._compute: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run once and keep the output buffer."""
        self._compute, self._out = compute, compute()
        return self._out

    def replay(self) -> None:
        """Recompute into the captured output buffer."""
        assert self._compute is not None and self._out is not None
        self._out.copy_(self._compute())


class DecodeGraphs:
    """Decode-only steps of up to max(buckets) rows, replayed per bucket."""

    def __init__(
        self,
        buckets: list[int],
        shape_for: Callable[[int], TritonShape],
        forward: Callable[[StepMetadata], torch.Tensor],
        device: torch.device,
        make_graph: Callable[[], Graph] | None = None,
    ) -> None:
        self.buckets = sorted(buckets)
        self.shape_for = shape_for
        self.forward = forward
        self.device = device
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        self._captured: dict[int, tuple[Graph, StepMetadata, torch.Tensor]] = {}
        self._failed: set[int] = set()
        self.replays = 0

    def bucket(self, num_decodes: int) -> int | None:
        """The smallest bucket holding `num_decodes` rows; None when the step is too big for graphs or that
        bucket could not be captured."""
        bucket = next((b for b in self.buckets if b >= num_decodes), None)
        return None if bucket in self._failed else bucket

    def run(
        self,
        bucket: int,
        packed: torch.Tensor,
        num_rows: int,
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Replay `bucket`'s graph on host metadata `packed` (laid out as shape_for(bucket)); the logits
        of the first `num_rows` rows, or None if the bucket's graph cannot be captured (run eagerly).
        `fill` writes ids the host does not have yet into the graph's input ids, after the copy."""
        captured = self._captured.get(bucket)
        if captured is None:
            try:
                captured = self._capture(bucket)
            except Exception:
                log.exception("capturing the decode graph of %d rows failed; those steps run eagerly", bucket)
                self._failed.add(bucket)
                return None
        graph, meta, logits = captured
        meta.packed.copy_(packed, non_blocking=True)
        if fill is not None:
            fill(meta.input_ids)
        graph.replay()
        self.replays += 1
        return logits[:num_rows]

    def _capture(self, bucket: int) -> tuple[Graph, StepMetadata, torch.Tensor]:
        shape = self.shape_for(bucket)
        packed = torch.zeros(sum(shape.section_sizes().values()), dtype=torch.int64, device=self.device)
        meta = StepMetadata(packed, shape)
        meta.slot_mapping.fill_(-1)  # capture on padding: nothing is stored
        meta.state_slots.fill_(-1)
        graph = self.make_graph()
        logits = graph.capture(lambda: self.forward(meta))
        self._captured[bucket] = (graph, meta, logits)
        return self._captured[bucket]
