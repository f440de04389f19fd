"""Per-request processors (core/processors.py) and the one place tokens are committed (`EngineCore.update`)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine_helpers import tiny_llm
from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.core.processors import Ending, LogitRows, Processors, RequestProcessor
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import FinishReason, Sequence, Status
from swarmkv.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Toy(RequestProcessor):
    """Records every hook it sees; ends a reply at `stop_at` (keeping the token before it)."""

    wants_hidden_states = True

    def __init__(self, stop_at: int | None = None, refuse: str | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.tokens: dict[str, list[int]] = {}
        self.hidden_rows = 0
        self.stop_at, self.refuse = stop_at, refuse

    def added(self, seq: Sequence) -> None:
        self.calls["added"] += 1
        if seq.request_id == self.refuse:
            raise InvalidRequestError("refused by the toy")
        self.tokens[seq.request_id] = []

    def draft_limit(self, request_id: str, draft: tuple[int, ...]) -> int:
        self.calls["draft_limit"] += 1
        return len(draft)

    def needs_ids(self, request_id: str) -> bool:
        self.calls["needs_ids"] += 1
        return False

    def prepare(self, chunks: list[Chunk]) -> None:
        self.calls["prepare"] += 1

    def logits(self, rows: LogitRows) -> None:
        self.calls["logits"] += 1
        assert rows.logits.shape[0] == sum(c.num_logits for c in rows.chunks)
        if rows.hidden is not None:
            self.hidden_rows += rows.hidden.shape[0]

    def forced(self, request_id: str, token_ids: list[int]) -> tuple[list[int], bool]:
        self.calls["forced"] += 1
        return token_ids, False

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        self.calls["appended"] += 1
        if self.stop_at is not None and self.stop_at in token_ids:
            return Ending(token_ids.index(self.stop_at), "stop")
        self.tokens[seq.request_id] += token_ids
        return None

    def ended(self, request_id: str) -> None:
        self.calls["ended"] += 1


def test_a_registered_processor_sees_every_hook() -> None:
    """A toy processor registered with an engine that drafts and looks ahead on nothing sees all eight hooks,
    the hidden states it asked for, and every token of the replies."""
    llm = tiny_llm(speculation="on", async_scheduling="on", block_size=4)
    engine = llm.engine
    toy = Toy()
    engine.processors.register(toy)
    engine.executor.runner.keep_hidden_states = True  # registered after the executor was built
    prompt = [5, 6, 7, 8] * 6
    replies: dict[str, list[int]] = {"a": [], "b": []}
    for rid in replies:  # b's reply follows a's, its sibling's: it drafts from it
        engine.add_request(rid, prompt, GREEDY)
        while engine.has_unfinished():
            for delta in engine.step():
                replies[delta.request_id] += delta.new_token_ids
            engine.check_integrity()
    assert set(toy.calls) == {
        "added",
        "draft_limit",
        "needs_ids",
        "prepare",
        "logits",
        "forced",
        "appended",
        "ended",
    }, toy.calls
    assert toy.calls["added"] == toy.calls["ended"] == 2
    assert toy.tokens == replies and all(len(r) == GREEDY.max_tokens for r in replies.values())
    assert toy.hidden_rows > 0, "the executor passed the rows' hidden states"
    with pytest.raises(InvalidRequestError, match="refused by the toy"):
        engine.processors.register(Toy(refuse="c"))
        engine.add_request("c", prompt, GREEDY)
    assert engine.get_sequence("c") is None and toy.calls["ended"] == 3, "a refusal queues nothing"


def _core(toy: Toy) -> tuple[EngineCore, Sequence]:
    core = EngineCore(
        EngineConfig(block_size=4), 16, max_model_len=64, processors=Processors([toy]), eos_token_ids=[2]
    )
    seq = core.add_request("r", list(range(10, 20)), SamplingParams(max_tokens=5, temperature=0.0))
    plan = core.schedule()
    core.commit(plan.chunks)
    return core, seq


def test_update_commits_tokens_up_to_a_stop_id() -> None:
    """One entry point appends a step's tokens, ends the reply at a stop id and finishes the request."""
    toy = Toy()
    core, seq = _core(toy)
    update = core.update(seq, [30])
    assert update.token_ids == [30] and update.reason is None and seq.status is Status.RUNNING
    assert core.counters.generated_tokens == 1
    update = core.update(seq, [31, 2, 33])  # a forced run, say: the end-of-turn id ends it
    assert update.token_ids == [31, 2] and update.reason == "stop"
    assert seq.status is Status.FINISHED and seq.output_token_ids == [30, 31, 2]
    core.forget("r")
    assert toy.calls["ended"] == 1 and core.get_sequence("r") is None
    core.check_integrity()


def test_update_ends_at_max_tokens_and_at_a_processors_ending() -> None:
    """max_tokens ends a reply inside a step's tokens; a processor's Ending takes the tokens after it back."""
    core, seq = _core(Toy())
    assert core.update(seq, [30, 31, 32, 33, 34, 35]).reason == "length"
    assert seq.output_token_ids == [30, 31, 32, 33, 34]
    core, seq = _core(Toy(stop_at=32))
    update = core.update(seq, [30, 31, 32, 33])
    assert update.token_ids == [30, 31] and update.reason == "stop"
    assert seq.output_token_ids == [30, 31] and seq.status is Status.FINISHED
    assert core.counters.generated_tokens == 2
    core.check_integrity()
