"""How long decoding a large body holds the server process's GIL: in a thread (`parse_json_body`, as the server
did) against the JSON worker process (`server/http/json_worker.py`), in one process, no server.

A ticker thread sleeps 1 ms at a time; the longest hold is the most CPU time this process spent inside one of
its gaps (the other thread ran while the ticker waited for the lock). CPU time, unlike the gap's wall time,
does not grow when a busy machine deschedules the process, so the figure holds on shared cores. Prints the
median and range over `--repeats` per body, and each decode's wall time:

    .venv/bin/python bench/json_worker_gil.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from swarmkv.api.errors import APIError, parse_json_body
from swarmkv.server.http.json_worker import JsonWorker

EMOJI_10MB = "\U0001f600" * 2_500_000
BODIES = {
    "10 MB emoji, escaped (30 MB)": json.dumps({"messages": [{"role": "user", "content": EMOJI_10MB}]}),
    "10 MB emoji, UTF-8": json.dumps(
        {"messages": [{"role": "user", "content": EMOJI_10MB}]}, ensure_ascii=False
    ),
    "7,500,000 stops (30 MB)": json.dumps({"stop": ["a"] * 7_500_000}, separators=(",", ":")),
    "2 MB of ASCII words": json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}]}),
}


def longest_hold_s(decode: Callable[[bytes], Any], raw: bytes) -> tuple[float, float]:
    """(the most CPU time spent inside one 1 ms ticker gap, the decode's wall time)."""
    holds: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last_cpu_s = time.process_time()
        while not stop.is_set():
            time.sleep(0.001)
            now_cpu_s = time.process_time()
            holds.append(now_cpu_s - last_cpu_s)
            last_cpu_s = now_cpu_s

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    start_s = time.perf_counter()
    kept = None
    with contextlib.suppress(APIError):
        kept = decode(raw)
    took_s = time.perf_counter() - start_s
    stop.set()
    ticker.join()
    del kept  # freed once the ticker stopped: its freeing is not the decode's
    return max(holds), took_s


def main() -> None:
    """Time each body both ways."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    worker = JsonWorker()
    worker.decode(json.dumps({"warm": "x" * (1 << 21)}).encode())  # the process started
    try:
        for name, text in BODIES.items():
            raw = text.encode()
            for how, decode in (("thread", parse_json_body), ("worker", worker.decode)):
                runs = [longest_hold_s(decode, raw) for _ in range(args.repeats)]
                holds_ms = sorted(1000 * hold for hold, _ in runs)
                took_ms = statistics.median(1000 * took for _, took in runs)
                print(
                    f"{name:30} {how}: longest hold median {statistics.median(holds_ms):6.1f} ms "
                    f"[{holds_ms[0]:.1f}-{holds_ms[-1]:.1f}], decode {took_ms:7.1f} ms"
                )
    finally:
        worker.close()


if __name__ == "__main__":
    main()
