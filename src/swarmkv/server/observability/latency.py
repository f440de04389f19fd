"""Latency: one request's time to first token and inter-token latency, observed as its outputs arrive."""

from __future__ import annotations

from swarmkv.api.outputs import StepOutput
from swarmkv.server.observability.metrics import ServerMetrics


class Latency:
    """Observes time to first token and inter-token latency of one request as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._last_s: float | None = None
        self._arrival_s = arrival_s

    def observe(self, out: StepOutput) -> None:
        """Record the output's latency if it carries tokens: one inter-token latency a token, 0 for the tokens
        after the first of an output of several (a draft's, a forced run's): they arrived with it."""
        if out.num_new_tokens == 0:
            return
        if self._last_s is None:
            self._metrics.time_to_first_token.observe(out.emitted_at_s - self._arrival_s)
        else:
            self._metrics.inter_token_latency.observe(out.emitted_at_s - self._last_s)
        for _ in range(out.num_new_tokens - 1):
            self._metrics.inter_token_latency.observe(0.0)
        self._last_s = out.emitted_at_s
