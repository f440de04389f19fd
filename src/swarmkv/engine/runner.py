"""ModelRunner: turn a step's plan into one flat batch, run the model over paged KV, return logits."""

from __future__ import annotations

import logging

import torch

import swarmkv.resolve as resolve
from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS, CascadeMode, PrefillBf16Mode, PrefillInt8Mode
from swarmkv.core.scheduler import Chunk, StepPlan, sampling_rows
from swarmkv.core.sequence import PROVISIONAL_TOKEN
from swarmkv.core.stats import EngineCounters
from swarmkv.engine import cpu_decode
from swarmkv.engine.backend import Backend
from swarmkv.engine.cascade import plan_groups
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.lookahead import ProvisionalInputs
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.paged_attention import PagedAttention, build_layout
from swarmkv.engine.recurrent_step import RecurrentStep, build_state_layout
from swarmkv.engine.state_cache import StateCache
from swarmkv.kernels import cpu_grouped
from swarmkv.kernels.cpu_decode import DecodeModel
from swarmkv.models import gguf_linear
from swarmkv.models.attention import AttentionBackend
from swarmkv.models.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the KV tensors and the resident page tables; knows nothing about queues or sampling."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        counters: EngineCounters,
        cascade_min_saved_tokens: int | None = None,
        backend: Backend = "torch",
        cuda_graphs: bool = False,
        mixed_step_graphs: bool = False,
        max_num_seqs: int = 1,
        max_model_len: int | None = None,
        states: StateCache | None = None,
        fused_cpu_decode: bool = False,
        cpu_int8_activations: bool = True,
        cpu_int8_residual_groups: int = CPU_INT8_RESIDUAL_GROUPS,
        cpu_prefill_bf16: PrefillBf16Mode = "off",
        cpu_prefill_int8: PrefillInt8Mode = "off",
    ) -> None:
        """With the triton backend, `cuda_graphs` replays decode steps of up to `max_num_seqs` rows, and with
        `mixed_step_graphs` steps with a few prefill chunks beside them (dense models). A hybrid
        model's linear-attention layers run over `states`, on either backend. `cascade_min_saved_tokens`:
        the reads a shared-prefix group must spare (`swarmkv.resolve.cascade_min_saved_tokens`; None: cascade off).
        `fused_cpu_decode`: run each step's decodes as one C call where the model allows (engine/cpu_decode.py),
        its projections on int8 activations if `cpu_int8_activations` (with the residual pass over
        `cpu_int8_residual_groups` groups a row). `cpu_prefill_bf16`: a CPU step's
        prefill chunks (no decode rows beside them in the modules) run under bfloat16 autocast, dense models
        (`swarmkv.resolve.cpu_prefill_bf16`, given whether the C step reads int8 activations and the CPU has AMX).
        `cpu_prefill_int8`: prefill chunks multiply K-quant blocks on int8 activations (`swarmkv.resolve.
        cpu_prefill_int8`, given whether the C step reads int8 activations and the build has the int8 GEMM)."""
        self.model = model
        self.states = states
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.counters = counters
        self.backend = backend
        self.page_size = kv_cache.block_size
        self.device = page_table.device
        self.dtype = kv_cache.dtype  # the model's, whatever the pages hold
        self.min_saved_tokens = cascade_min_saved_tokens
        self.triton = None
        self.cuda_graphs = cuda_graphs and backend == "triton"
        if backend == "triton":
            from swarmkv.engine.cuda_graphs import batch_buckets  # these import triton: only when asked for
            from swarmkv.engine.triton_runner import TritonRunner

            max_keys = max_model_len or page_table.host.shape[1] * self.page_size
            buckets = batch_buckets(max_num_seqs) if cuda_graphs else None
            self.triton = TritonRunner(
                model, kv_cache, page_table, buckets, max_keys, states=states, mixed_graphs=mixed_step_graphs
            )
        # The executor's seam: each sampling row's last hidden state, kept by a forward through the modules
        # only while a processor reads them (`hidden_states`, None otherwise).
        self.keep_hidden_states = False
        self.hidden_states: torch.Tensor | None = None
        # The MTP drafter's seam: every row's hidden state, with the chunks in row order (`step_rows`).
        self.step_rows: tuple[list[Chunk], torch.Tensor] | None = None
        self.cpu_decode: DecodeModel | None = None
        if fused_cpu_decode and backend == "torch":
            reason = cpu_decode.why_not(model, kv_cache, self.device)
            if reason is None:
                self.cpu_decode = cpu_decode.describe(
                    model, kv_cache, page_table, cpu_int8_activations, cpu_int8_residual_groups, states
                )
            else:
                log.info("decode steps run through the torch modules: %s", reason)
        # Where decodes already read int8 activations, bfloat16 prefills round less than they do and, on AMX, take
        # half the time (EngineConfig.cpu_prefill_bf16's help has the measurements).
        rounded_decodes = self.cpu_decode is not None and self.cpu_decode.reads_int8
        self.prefill_bf16 = resolve.cpu_prefill_bf16(
            cpu_prefill_bf16, self.device.type, states is not None, rounded_decodes, amx_tiles()
        )
        self.prefill_int8 = resolve.cpu_prefill_int8(
            cpu_prefill_int8, self.device.type, rounded_decodes, cpu_grouped.has_int8_gemm()
        )
        gguf_linear.use_prefill_int8(model, self.prefill_int8)

    @torch.inference_mode()
    def run(
        self, plan: StepPlan, provisional: ProvisionalInputs | None = None
    ) -> tuple[list[Chunk], torch.Tensor]:
        """Compute every chunk (after `update_page_table(plan)`); return the chunks that sample, in the
        order of their rows of float32 logits [N, vocab]. A decode chunk whose last token is provisional
        (async scheduling) reads its input id from `provisional`, the previous step's ids on the device."""
        self.hidden_states, self.step_rows = None, None
        prefills = [c for c in plan.chunks if c.kind == "prefill"]
        decodes = [c for c in plan.chunks if c.kind == "decode"]
        if self.cpu_decode is None:
            # A speculative chunk computes several positions of one request, as a prefill's chunk does (the C
            # step runs it as a row per position, a hybrid's keeping its states after each for the rewind).
            prefills += [c for c in decodes if c.draft]
            decodes = [c for c in decodes if not c.draft]
        if self.cpu_decode is not None and decodes:
            # The decodes in C, any prefills through the modules first (a hybrid's modules begin the step's kept
            # states, which C then fills): a second pass over the weights costs less than decode rows in the
            # modules, which gather every key of their context layer by layer.
            if not prefills:
                return self._run_cpu_decode(self.cpu_decode, decodes, plan.state_slots, provisional)
            prefill_sampling, prefill_logits = self._run_modules(plan, prefills, [], [], provisional)
            modules_rows = self.step_rows
            sampling, logits = self._run_cpu_decode(self.cpu_decode, decodes, plan.state_slots, provisional)
            if modules_rows is not None and self.step_rows is not None:  # the modules' rows, then C's
                self.step_rows = (
                    modules_rows[0] + self.step_rows[0],
                    torch.cat([modules_rows[1].to(self.dtype), self.step_rows[1]]),
                )
            return prefill_sampling + sampling, torch.cat([prefill_logits, logits])
        groups, decodes = self._group_decodes(decodes, self.min_saved_tokens)
        return self._run_modules(plan, prefills, decodes, groups, provisional)

    def _run_modules(
        self,
        plan: StepPlan,
        prefills: list[Chunk],
        decodes: list[Chunk],
        groups: list[tuple[int, int]],
        provisional: ProvisionalInputs | None,
    ) -> tuple[list[Chunk], torch.Tensor]:
        """The chunks through the torch modules (or the triton runner), decodes grouped as `groups` says."""
        sampling = [c for c in prefills + decodes if c.samples]
        if self.triton is not None:
            return sampling, self.triton.run(prefills, decodes, groups, plan.state_slots, provisional)
        layout, input_ids, positions = build_layout(self.page_table, prefills, decodes, groups, self.dtype)
        if provisional is not None:
            provisional.fill(input_ids, prefills + decodes)
        backend: AttentionBackend = PagedAttention(self.kv_cache, layout)
        if self.states is not None:
            state_layout = build_state_layout(prefills, decodes, plan.state_slots, self.device)
            backend = RecurrentStep(backend, self.states, state_layout)
        # Prefill chunks alone are compute-bound: bfloat16 matmuls and attention where asked (AMX, AVX-512 BF16).
        # Never for a draft's rows: verification must see the logits a decode would.
        bf16 = self.prefill_bf16 and not decodes and not any(c.draft for c in prefills)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden = self.model(input_ids, positions, backend)
        if self.model.mtp is not None:
            self.step_rows = (prefills + decodes, hidden)
        rows = torch.tensor(sampling_rows(prefills + decodes), dtype=torch.int64, device=self.device)
        last_hidden = hidden[rows].to(self.dtype)
        if self.keep_hidden_states:
            self.hidden_states = last_hidden
        return sampling, self.model.compute_logits(last_hidden)

    def update_page_table(self, plan: StepPlan) -> None:
        """Drop freed requests' rows, append the pages each request gained, copy the changes once."""
        self.page_table.drop(plan.freed)
        for rid, pages in plan.new_pages.items():
            self.page_table.append(rid, pages)
        self.page_table.sync()

    def _run_cpu_decode(
        self,
        step: DecodeModel,
        decodes: list[Chunk],
        state_slots: dict[str, int],
        provisional: ProvisionalInputs | None,
    ) -> tuple[list[Chunk], torch.Tensor]:
        """A step's decodes in one C call, a speculative chunk as a row for each of its positions: the step
        stores every row's KV before any row attends, so a draft token reads the ones before it, and runs a
        hybrid's rows of one slot through its states in order, keeping each position's for the rewind. Its
        attention reads a group's shared pages once at no extra cost, so any saving is worth a group
        (cascade off still turns grouping off)."""
        assert all(c.samples for c in decodes), "a decode chunk ends at its request's last token"
        # (chunk, offset) for every position computed, in the chunks' order; logits come back in that order.
        items = [(c, j) for c in decodes for j in range(c.num_tokens)]
        table_rows = [self.page_table.row(c.request_id) for c, _ in items]
        positions = [c.start + j for c, j in items]
        groups, order = self._group_rows(
            table_rows, positions, 1 if self.min_saved_tokens is not None else None
        )
        sizes = [size for size, _ in groups]
        sizes += [1] * (len(order) - sum(sizes))
        shared = [pages * self.page_size for _, pages in groups]
        shared += [0] * (len(sizes) - len(shared))
        input_ids = torch.tensor([items[i][0].token_ids[items[i][1]] for i in order], dtype=torch.int64)
        if provisional is not None:
            rows = [r for r, i in enumerate(order) if items[i][0].token_ids[items[i][1]] == PROVISIONAL_TOKEN]
            picks = [provisional.index[items[order[r]][0].request_id] for r in rows]
            provisional.fill_rows(input_ids, rows, picks)
        slots = drafts = None  # a hybrid's rows each continue their request's state slot
        if self.states is not None:
            slots = torch.tensor([state_slots[items[i][0].request_id] for i in order], dtype=torch.int64)
            drafts = cpu_decode.draft_positions([items[i] for i in order], state_slots)
        logits = step.step(
            input_ids,
            torch.tensor([table_rows[i] for i in order], dtype=torch.int64),
            torch.tensor([positions[i] for i in order], dtype=torch.int64),
            sizes,
            shared,
            slots,
            None if drafts is None else drafts.rows,
            hidden := torch.empty(len(order), self.model.config.hidden_size) if self.model.mtp else None,
        )
        if self.states is not None:
            cpu_decode.keep_positions(self.states, step, drafts)
        if order != list(range(len(order))):
            inverse = torch.empty(len(order), dtype=torch.int64)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            logits = logits[inverse]
            hidden = None if hidden is None else hidden[inverse]
        if hidden is not None:  # the MTP drafter's: each chunk's positions, in the chunks' order
            self.step_rows = (decodes, hidden)
        return decodes, logits

    def _group_decodes(
        self, decodes: list[Chunk], min_saved_tokens: int | None
    ) -> tuple[list[tuple[int, int]], list[Chunk]]:
        """Cascade groups as (number of decodes, shared pages), grouped decodes first, in group order."""
        rows = [self.page_table.row(c.request_id) for c in decodes]
        groups, order = self._group_rows(rows, [c.start for c in decodes], min_saved_tokens)
        return groups, [decodes[i] for i in order]

    def _group_rows(
        self, rows: list[int], positions: list[int], min_saved_tokens: int | None
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Cascade groups of decode rows (page-table `rows`, each decoding at its position) as (members,
        shared pages), and the rows' order: grouped rows first, in group order. `min_saved_tokens`: the reads a
        group must spare (None: no groups)."""
        shareable = [position // self.page_size for position in positions]
        # plan_groups' threshold mode: a group forms where it spares `min_saved_tokens` reads.
        mode: CascadeMode = "off" if min_saved_tokens is None else "auto"
        groups = plan_groups(
            self.page_table.host, rows, shareable, self.page_size, mode, min_saved_tokens or 1
        )
        order = [i for g in groups for i in g.members]
        rest = sorted(set(range(len(rows))) - set(order))
        sizes = [(len(g.members), g.num_pages) for g in groups]
        for g in groups:
            self.counters.cascade_decode_rows += len(g.members)
            self.counters.cascade_shared_tokens += g.num_pages * self.page_size
        return sizes, order + rest


def amx_tiles() -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles (torch's own check; False where torch lacks it)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False
