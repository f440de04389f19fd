"""The executor: a step's forward, the processors' logits hooks, draft verification and sampling, returning
each sampling chunk's accepted ids (vLLM v1's `execute_model`, whose runner samples and verifies).

Under async scheduling, a step nothing needs to wait for leaves its ids on the device instead (`InFlight`),
read when the next step has launched. Where a processor asks (`wants_hidden_states`), the logits hook also
gets each sampling row's last hidden state; nothing is kept when none does.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.core.drafts import Drafts
from swarmkv.core.processors import LogitRows, Processors
from swarmkv.core.scheduler import Chunk, StepPlan
from swarmkv.core.stats import EngineCounters
from swarmkv.engine.backend import Backend
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.lookahead import InFlight, Lookahead, ProvisionalInputs
from swarmkv.engine.mtp import MTPDrafter
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.runner import ModelRunner
from swarmkv.engine.sampler import SeededSampling, greedy_ids, sample, sample_on_device
from swarmkv.engine.speculative import verify_greedy, verify_sampled
from swarmkv.engine.state_cache import StateCache
from swarmkv.kv import pages_for
from swarmkv.models.loader import LoadedModel
from swarmkv.spec.chooser import DraftChooser


@dataclass(frozen=True)
class RowOutput:
    """What one sampling chunk yields: its accepted draft tokens (if it verified a draft), then one more."""

    chunk: Chunk
    token_ids: list[int]


@dataclass(frozen=True)
class StepOutput:
    """A step's results: every sampling chunk's ids, or the step launched with its ids on the device."""

    rows: list[RowOutput]
    launched: InFlight | None = None


class Executor:
    """Runs plans on the model; knows nothing about queues or pages."""

    def __init__(
        self,
        runner: ModelRunner,
        processors: Processors,
        seeded: SeededSampling,
        drafts: Drafts | None,
        lookahead: Lookahead,
    ) -> None:
        self.runner = runner
        self.processors = processors
        self.seeded = seeded
        self.drafts = drafts
        self.lookahead = lookahead
        runner.keep_hidden_states = processors.wants_hidden_states
        # The model's MTP layer drafts after each step where the drafts' chooser takes its drafts.
        # (The Triton runner keeps no hidden states yet: there the chooser gets text drafts only.)
        self.mtp: MTPDrafter | None = None
        chooser = drafts.drafter if drafts is not None else None
        if isinstance(chooser, DraftChooser) and runner.model.mtp is not None and runner.triton is None:
            self.mtp = MTPDrafter(runner.model, runner.kv_cache, runner.page_table, chooser)

    @staticmethod
    def runner_for(
        loaded: LoadedModel,
        config: EngineConfig,
        kv: KVCache,
        states: StateCache | None,
        counters: EngineCounters,
        backend: Backend,
        max_model_len: int,
    ) -> ModelRunner:
        """The runner `config` asks for over these tensors, with resident page tables for `max_num_seqs`."""
        max_pages = pages_for(max_model_len, config.block_size)  # a request that fills the context
        return ModelRunner(
            loaded.model,
            kv,
            PageTable(config.max_num_seqs, max_pages, config.block_size, loaded.device),
            counters,
            cascade_min_saved_tokens=resolve.cascade_min_saved_tokens(
                config.cascade_attention, backend, config.cascade_min_saved_tokens
            ),
            backend=backend,
            cuda_graphs=resolve.cuda_graphs(loaded.device.type, backend, config.enforce_eager),
            mixed_step_graphs=config.mixed_step_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            states=states,
            fused_cpu_decode=config.fused_cpu_decode,
            cpu_int8_activations=config.cpu_int8_activations,
            cpu_int8_residual_groups=config.cpu_int8_residual_groups,
            cpu_prefill_bf16=config.cpu_prefill_bf16,
            cpu_prefill_int8=config.cpu_prefill_int8,
        )

    def execute(self, plan: StepPlan, provisional: ProvisionalInputs | None) -> StepOutput:
        """Compute the plan's chunks (`provisional`: the step in flight's ids, inputs of its decodes), then
        verify drafts and sample the rest."""
        self.processors.prepare(plan.chunks)  # a grammar's masks are computed meanwhile
        start = time.perf_counter()
        sampling, logits = self.runner.run(plan, provisional)
        step_s = time.perf_counter() - start
        hidden = self.runner.hidden_states
        if hidden is not None and hidden.shape[0] != logits.shape[0]:
            hidden = None  # some rows ran where no hidden state is kept (the CPU's C decode step)
        self.processors.logits(LogitRows(sampling, logits, hidden))
        generators = [self.seeded.generator(c.request_id) for c in sampling]
        verified = self.verify(sampling, logits, generators) if any(c.draft for c in sampling) else {}
        # The other chunks sample from their one row (a speculative chunk's rows were verified above).
        plain = [i for i in range(len(sampling)) if i not in verified]
        if verified:
            ends = list(itertools.accumulate(c.num_logits for c in sampling))
            rows = torch.tensor([ends[i] - 1 for i in plain], dtype=torch.int64, device=logits.device)
            logits = logits[rows]
        params, plain_generators = [sampling[i].seq.params for i in plain], [generators[i] for i in plain]
        if self.lookahead.may_run_ahead(sampling, self.processors):
            return StepOutput(
                [], InFlight.start(sampling, sample_on_device(logits, params, plain_generators))
            )
        tokens = dict(zip(plain, sample(logits, params, plain_generators) if plain else [], strict=True))
        out = [RowOutput(c, verified[i] if i in verified else [tokens[i]]) for i, c in enumerate(sampling)]
        if self.mtp is not None and self.runner.step_rows is not None:
            chunks, hidden = self.runner.step_rows
            self.mtp.after_step(chunks, hidden, {r.chunk.request_id: r.token_ids for r in out}, step_s)
        return StepOutput(out)

    def verify(
        self, sampling: list[Chunk], logits: torch.Tensor, generators: list[torch.Generator]
    ) -> dict[int, list[int]]:
        """The tokens each speculative chunk yields (by its index in `sampling`), from its rows of logits; the
        drafts learn what was accepted."""
        out: dict[int, list[int]] = {}
        choices = (
            greedy_ids(logits).tolist() if any(c.draft and c.seq.params.greedy for c in sampling) else []
        )
        first = 0
        for i, chunk in enumerate(sampling):
            rows = slice(first, first + chunk.num_logits)
            first += chunk.num_logits
            if not chunk.draft:
                continue
            if chunk.seq.params.greedy:
                out[i] = verify_greedy(choices[rows], chunk.draft)
            else:
                out[i] = verify_sampled(logits[rows], chunk.draft, chunk.seq.params, generators[i])
        for i, tokens in out.items():
            assert self.drafts is not None, "drafts without a drafter"
            self.drafts.verified(sampling[i].request_id, len(sampling[i].draft), len(tokens) - 1)
        return out
