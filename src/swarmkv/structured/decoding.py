"""The engine's side of constrained decoding: one llguidance matcher per request, masks, forced tokens.

A step's masks depend only on the tokens its requests hold before the step, so `prefetch` computes them
on a thread while the forward runs (llguidance drops the GIL) and `apply` waits for them and masks the
logits on their device, one batched op over the constrained rows. After sampling, `advance` feeds the
sampled token (after a speculative step's accepted draft tokens) to the matcher and returns what to append:
the token, then every token the grammar forces after it (jump-forward; the engine appends them at once and the
next step computes them as one chunk).
With jump-forward off, forced tokens are queued and appended one a step instead of a sampled token, so
the two ways give the same tokens. A speculative chunk's rows are masked along its draft (llguidance's masks
with draft tokens); `draftable` keeps a draft to what the grammar allows before any forced run, so the rows
verified are the rows a decode without drafts would have sampled. Compiled grammars are cached by text within
a scope, the root of the request's cache salt (a tenant's name under `--api-keys`) (`GrammarCache`): agents
that share their tools compile them once, and no tenant's hit, count or timing tells of another's schema. With `close_at_length`, `fit` forces a
reply's ending (`closing.py`) once the tokens left to its max_tokens come down to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np
import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.structured.closing import Closer
from swarmkv.structured.grammars import UnsupportedSchemaError
from swarmkv.structured.loop_guard import JsonStrings
from swarmkv.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 512
# Far from its length a reply's ending is looked for every this many steps; near it (tokens left within twice
# the ending and this margin), every step, and it drafts nothing, so no step takes it past the ending.
CLOSE_CHECK_STEPS = 8
CLOSE_NEAR_MARGIN = 16


class GrammarCache:
    """Compiled grammars of one tokenizer, by scope and grammar text; each request gets a copy of the compiled
    one. The scope is the boundary the prefix cache keeps too (the salt's root), so a grammar another scope
    compiled is compiled again, as if unseen."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # The vocabulary is the logits' width (a model's embedding rows may outnumber the tokenizer's ids).
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids)
        )
        self._compiled: OrderedDict[tuple[str | None, str], llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0
        self.num_hits = 0

    def matcher(self, grammar: str, scope: str | None = None) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start, compiled once in `scope`; UnsupportedSchemaError if the
        grammar does not compile."""
        key = (scope, grammar)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise UnsupportedSchemaError(f"the grammar does not compile: {compiled.get_error()}")
            self.num_compiled += 1
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self.num_hits += 1
            self._compiled.move_to_end(key)
        return compiled.deep_copy()


@dataclass
class GrammarState:
    """One request's matcher, and the forced tokens it consumed ahead of the sequence."""

    matcher: llguidance.LLMatcher
    # Forced tokens the matcher has consumed that wait to be appended (at the start, or one a step).
    queued: list[int] = field(default_factory=list)
    # Closing at the length (`StructuredDecoding.fit`): the ending from the matcher's state when it was last
    # looked for this step (None: not looked for), whether the reply is near its length, steps to the next
    # look while it is not, whether an ending was forced, and what the latest `advance` consumed (None: it
    # appended queued tokens in place of the sample).
    ending: list[int] | None = None
    near: bool = False
    countdown: int = 0
    closed: bool = False
    consumed: int | None = None


@dataclass
class MaskJob:
    """Masks being computed for one step: a packed int32 bitmask row per constrained request."""

    rows: dict[str, int]  # request id -> row of `bitmask`
    bitmask: np.ndarray
    done: Future[None]


class StructuredDecoding:
    """Per-request grammar state; the engine calls add, prefetch, apply, advance and drop."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, jump_forward: bool, close_at_length: bool = True
    ) -> None:
        self.grammars = GrammarCache(tokenizer, vocab_size)
        self.closer = Closer(self.grammars.tokenizer) if close_at_length else None
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self._rows: dict[str, GrammarState] = {}
        self._executor = llguidance.LLExecutor(num_threads=1)  # beside the forward's threads, not over them
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmkv-grammar-masks")
        self.num_forced_tokens = 0
        self._json_strings: JsonStrings | None = None

    @property
    def json_strings(self) -> JsonStrings:
        """The vocabulary's quoting tokens, for the loop guard's close bias (built on first use)."""
        if self._json_strings is None:
            tokenizer = self.grammars.tokenizer
            self._json_strings = JsonStrings.of(self.vocab_size, lambda t: tokenizer.decode_bytes([t]))
        return self._json_strings

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def start(self, grammar: str, prefix: str = "", scope: str | None = None) -> GrammarState:
        """A matcher past `prefix` (grammar text the prompt already holds), the tokens it forces next queued,
        its compiled grammar shared within `scope` only; UnsupportedSchemaError if the grammar does not compile
        or refuses the prefix (nothing is added: `add` does that once the request is queued)."""
        matcher = self.grammars.matcher(grammar, scope)
        if prefix:
            # The parser reads bytes, so the prefix's own tokenization is as good as the prompt's.
            matcher.consume_tokens(self.grammars.tokenizer.tokenize_str(prefix, parse_special=True))
            if matcher.is_error():
                raise UnsupportedSchemaError(
                    f"the reply's opening does not fit its grammar: {matcher.get_error()}"
                )
        forced = matcher.compute_ff_tokens()
        if forced:
            matcher.consume_tokens(forced)
        ending = self.closer.ending(matcher) if self.closer is not None else None
        return GrammarState(matcher, list(forced), ending)

    def add(self, request_id: str, state: GrammarState) -> None:
        """Track a queued request's grammar state."""
        assert request_id not in self._rows, f"{request_id} already has a grammar"
        self._rows[request_id] = state

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or failed)."""
        self._rows.pop(request_id, None)

    def draftable(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many of a draft's first tokens the request's next step may verify: tokens its grammar allows,
        and none after which the grammar stops or forces a run (the reply takes the run there, not the
        draft's next rows), nor any while forced tokens wait. The matcher is left as it was."""
        row = self._rows.get(request_id)
        if row is None:
            return len(tokens)
        if row.queued or row.near or row.closed or not tokens:
            return 0
        matcher = row.matcher
        valid = matcher.validate_tokens(list(tokens))
        taken = 0
        while taken < valid:
            matcher.consume_token(tokens[taken])
            if matcher.is_stopped() or matcher.compute_ff_tokens():
                break  # the token that forces (or ends) stays out: it is the step's own choice
            taken += 1
        matcher.rollback(taken + (taken < valid))
        assert not matcher.is_error(), matcher.get_error()
        return taken

    def prefetch(self, chunks: Sequence[Chunk]) -> MaskJob | None:
        """Start computing the masks of this step's constrained sampling rows (a speculative chunk's rows
        along its draft); None when there are none."""
        rows: dict[str, int] = {}
        matchers: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        num_rows = 0
        for chunk in chunks:
            row = self._rows.get(chunk.request_id)
            if chunk.samples and row is not None and not row.queued:  # a queued token replaces the sample
                rows[chunk.request_id] = num_rows
                matchers.append((row.matcher, num_rows, list(chunk.draft)))
                num_rows += chunk.num_logits
        if not matchers:
            return None
        bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        return MaskJob(rows, bitmask, self._thread.submit(_fill_masks, self._executor, matchers, bitmask))

    def apply(self, job: MaskJob | None, sampling: Sequence[Chunk], logits: torch.Tensor) -> None:
        """Wait for the masks and set every disallowed token's logit to -inf, in place, on the logits' device
        (`logits`: the chunks' `num_logits` rows each, in order)."""
        if job is None:
            return
        job.done.result()
        logit_rows: list[int] = []
        mask_rows: list[int] = []
        first = 0
        for chunk in sampling:
            at = job.rows.get(chunk.request_id)
            if at is not None:
                logit_rows.extend(range(first, first + chunk.num_logits))
                mask_rows.extend(range(at, at + chunk.num_logits))
            first += chunk.num_logits
        if not logit_rows:
            return
        with torch.inference_mode():  # the runner's logits are inference tensors
            banned = _disallowed(job.bitmask[mask_rows], logits.shape[-1], logits.device)
            if logit_rows == list(range(logits.shape[0])):
                logits.masked_fill_(banned, float("-inf"))  # every row constrained: one op, in place
            else:
                for j, row in enumerate(logit_rows):  # in place, row by row: no copy of the batch's logits
                    logits[row].masked_fill_(banned[j], float("-inf"))

    def advance(self, request_id: str, tokens: Sequence[int]) -> list[int]:
        """The tokens to append after a step yielded `tokens`: a speculative step's accepted draft tokens
        (`draftable` vetted them: none forces a run or ends the grammar), then the token it sampled. In place of
        that last: a queued forced token (all queued ones under jump-forward), else the sampled token and, under
        jump-forward, the run the grammar forces after it. Each token is one the mask allowed (an AssertionError
        otherwise)."""
        row = self._rows.get(request_id)
        if row is None:
            return list(tokens)
        if row.queued:  # a queued token replaces the sample (`draftable` drafts nothing while tokens wait)
            assert len(tokens) == 1, "a draft while forced tokens wait"
            take = len(row.queued) if self.jump_forward else 1
            queued, row.queued, row.consumed = row.queued[:take], row.queued[take:], None
            self.num_forced_tokens += len(queued)
            return queued
        for token in tokens:
            accepted = row.matcher.consume_token(token)
            assert accepted and not row.matcher.is_error(), row.matcher.get_error()
        row.consumed = len(tokens)
        if row.matcher.is_stopped():
            return list(tokens)
        forced = row.matcher.compute_ff_tokens()
        if not forced:
            return list(tokens)
        row.matcher.consume_tokens(forced)
        row.consumed += len(forced)
        if self.jump_forward:
            self.num_forced_tokens += len(forced)
            return [*tokens, *forced]
        row.queued = list(forced)
        return list(tokens)

    def fit(self, request_id: str, tokens_left: int, appended: list[int]) -> list[int]:
        """What the request appends in place of `appended` (what `advance` returned) with `tokens_left` to its
        max_tokens before them: the same while its grammar's ending is shorter than the tokens left after them;
        that ending after them once it is as long. Where the step's own token took the ending past the tokens
        left, the ending from before that token replaces it (the reply then closes early)."""
        row = self._rows.get(request_id)
        if row is None or self.closer is None or row.closed:
            return appended
        left = tokens_left - len(appended) - len(row.queued)
        previous, row.ending = row.ending, None
        if left <= 0 or row.matcher.is_stopped():
            return appended
        row.countdown -= 1
        if not row.near and row.countdown > 0:
            return appended
        ending = row.ending = self.closer.ending(row.matcher)
        row.countdown = CLOSE_CHECK_STEPS
        row.near = ending is not None and left <= 2 * len(ending) + CLOSE_NEAR_MARGIN
        if ending is None or left > len(ending):
            return appended
        if left < len(ending) and previous and len(previous) <= tokens_left and row.consumed is not None:
            row.matcher.rollback(row.consumed)
            row.queued, appended, ending = [], [], previous
        row.matcher.consume_tokens(ending)
        row.closed = True
        if self.jump_forward:
            self.num_forced_tokens += len(ending)
            return [*appended, *ending]
        row.queued.extend(ending)
        if appended:
            return appended
        self.num_forced_tokens += 1
        first, row.queued = row.queued[:1], row.queued[1:]
        return first

    def closed(self, request_id: str) -> bool:
        """Whether the request's ending was forced at its length."""
        row = self._rows.get(request_id)
        return row is not None and row.closed

    def is_complete(self, request_id: str) -> bool:
        """Whether the request's grammar has ended (nothing but the end of the reply may follow)."""
        row = self._rows.get(request_id)
        return row is not None and not row.queued and bool(row.matcher.is_stopped())


def _fill_masks(
    executor: llguidance.LLExecutor,
    matchers: list[tuple[llguidance.LLMatcher, int, list[int]]],
    bitmask: np.ndarray,
) -> None:
    """Each matcher's masks from its row on: one, or one more a draft token (llguidance wants those apart)."""
    plain = [(matcher, at) for matcher, at, draft in matchers if not draft]
    drafted = [entry for entry in matchers if entry[2]]
    if plain:
        llguidance.numpy.fill_next_token_bitmask_par(executor, plain, bitmask)
    if drafted:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, bitmask)


def _disallowed(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed int32 bitmask rows [N, ceil(V / 32)] -> bool [N, vocab_size], True where a token is banned;
    unpacked by numpy on the CPU (one pass over bytes), by shifts on an accelerator."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
        banned = torch.from_numpy(bits[:, :vocab_size] == 0)
    else:
        # Pinned on a GPU, so the copy does not wait for the device. (The masks are numpy arrays because
        # llguidance.torch imports torch.compile's stack: seconds of every start-up.)
        words = torch.from_numpy(bitmask)
        words = (words.pin_memory() if device.type == "cuda" else words).to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        banned = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size] == 0
    if banned.shape[-1] < vocab_size:  # logits wider than the mask: ids past it are never allowed
        banned = torch.nn.functional.pad(banned, (0, vocab_size - banned.shape[-1]), value=True)
    return banned
