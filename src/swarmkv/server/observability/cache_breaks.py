"""Cache breaks, live: where a chat prompt stops continuing its session's (or salt's) earlier prompts, and why.

A session's next turn should continue its previous prompt, so the prefix cache serves all of it. When a
prompt instead diverges from the most similar earlier prompt of its session or cache salt before that
prompt's end, the KV after the divergence is computed again: a cache break. `swarmkv lint`'s classifier
names the cause (a timestamp, a random id, reordered tools, an edited system prompt...). Each break is
counted in `swarmkv_cache_breaks_total{cause}`, logged at INFO with its tenant, session, offset and cause (the
prompt text where it diverged only with `--log-cache-break-text`: a log is no place for prompts by default),
and returned to a client that asks for `swarmkv_diagnostics`. A request with neither a session nor a salt
is compared with nothing: unrelated agents sharing a system prompt diverge by design. Under `--api-keys` the
session and salt arrive scoped to their tenant (`tenants.py`), so a prompt is only ever compared with its own
tenant's.

The prompts are remembered on the event loop, in request order; the comparison and the classifier run on
a worker thread, never on the engine's thread, while the request generates.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Awaitable, Hashable
from typing import Any

from prometheus_client import Counter

from swarmkv.breaks.causes import CAUSES, Break, RenderedPrompt, classify, divergence
from swarmkv.kv.retention import GROUP_SEP
from swarmkv.prefix import common_prefix_length
from swarmkv.server.observability.prompt_history import PromptHistory, StoredPrompt
from swarmkv.tokenizer import Tokenizer

log = logging.getLogger(__name__)

EVIDENCE_CHARS = 160  # of a break's evidence text, in the log line


class CacheBreaks:
    """Compares each chat prompt with its session's and salt's earlier prompts; counts and logs breaks."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        counter: Counter,
        history: PromptHistory | None = None,
        log_text: bool = False,
    ) -> None:
        """`log_text`: each break's log line carries the prompt text where it diverged."""
        self.tokenizer = tokenizer
        self.log_text = log_text
        self.counter = counter  # labelled by cause
        for cause in CAUSES:  # every cause shows in /metrics from the start, at 0
            counter.labels(cause=cause)
        self.history = history or PromptHistory()

    def watch(
        self, session_id: str | None, salt: str | None, prompt: RenderedPrompt, tenant: str | None = None
    ) -> Awaitable[Break | None]:
        """Remember `prompt` now; the returned awaitable gives its break (None: it continues, or is first).
        `session_id` and `salt` are the engine's (scoped to `tenant`, the tenant's name, which the log names).

        Call it on the event loop once the engine accepted the request, so that prompts are remembered
        in the order their requests arrived. The awaitable never raises: a classifier failure is logged.
        """
        keys: list[Hashable] = []
        if session_id is not None:
            keys.append(("session", session_id))
        if salt is not None:
            keys.append(("salt", salt))
        loop = asyncio.get_running_loop()
        if not keys:
            done: asyncio.Future[Break | None] = loop.create_future()
            done.set_result(None)
            return done
        ids = array("I", prompt.token_ids)
        earlier = self.history.earlier(keys)
        self.history.add(keys, StoredPrompt(ids, prompt.text, prompt.messages, prompt.tools))
        return loop.run_in_executor(None, self._find_break, earlier, ids, prompt, session_id, tenant)

    def _find_break(
        self,
        earlier: list[StoredPrompt],
        ids: array,
        prompt: RenderedPrompt,
        session_id: str | None,
        tenant: str | None,
    ) -> Break | None:
        try:
            return self._classify(earlier, ids, prompt, session_id, tenant)
        except Exception:
            log.exception("classifying a cache break failed (tenant %s)", tenant)
            return None

    def _classify(
        self,
        earlier: list[StoredPrompt],
        ids: array,
        prompt: RenderedPrompt,
        session_id: str | None,
        tenant: str | None,
    ) -> Break | None:
        # The newest of the most similar prompts: `earlier` is newest first, and max keeps the first.
        best = max(earlier, key=lambda p: common_prefix_length(p.token_ids, ids), default=None)
        if best is None:
            return None
        before = RenderedPrompt(list(best.token_ids), best.text, best.messages, best.tools)
        offset = divergence(before.token_ids, prompt.token_ids)
        if offset >= len(before.token_ids):
            return None  # it continues the earlier prompt: everything cached before is reused
        found = classify(before, prompt, offset, self.tokenizer)
        self.counter.labels(cause=found.cause).inc()
        # The session as the client sent it (the engine's is scoped: TENANT\0ID).
        session = session_id.rpartition(GROUP_SEP)[2] if session_id is not None else None
        line = "cache break: tenant=%s session=%s offset=%d cause=%s"
        args: tuple[object, ...] = (tenant, session, found.offset, found.cause)
        if self.log_text:
            line, args = line + " evidence=%r", (*args, found.text[:EVIDENCE_CHARS])
        log.info(line, *args)
        return found


def with_diagnostics(usage: dict[str, Any], found: Break | None) -> dict[str, Any]:
    """`usage` plus `swarmkv.cache_break`: the break's token offset and cause, or None."""
    cache_break = None if found is None else {"offset": found.offset, "cause": found.cause}
    return {**usage, "swarmkv": {"cache_break": cache_break}}
