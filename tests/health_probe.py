"""Timing /health from a thread while a test's block runs; a /health that fails fails the test."""

from __future__ import annotations

import threading
import time

import httpx


class HealthProbe:
    """Times /health every `interval_s` on its own thread while a block runs. An answer other than 200 (or an
    exception) is kept and raised when the block ends: in the thread, an assert would only end the thread."""

    def __init__(self, url: str, interval_s: float = 0.01, timeout_s: float = 60.0) -> None:
        self.url = url
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout_s) as client:
            while not self._stop.is_set():
                start_s = time.perf_counter()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                else:
                    if status != 200:
                        self.failures.append(f"/health answered {status}")
                self.latencies_s.append(time.perf_counter() - start_s)
                self._stop.wait(self._interval_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        assert not self.failures, self.failures[:3]

    @property
    def worst_s(self) -> float:
        return max(self.latencies_s, default=0.0)

    @property
    def p99_s(self) -> float:
        ordered = sorted(self.latencies_s) or [0.0]
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
