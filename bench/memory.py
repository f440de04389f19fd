"""Resident memory of `swarmkv serve` on the embedded model, by weight format, measured in one run.

Starts the server once per format (float, int8, auto: the GGUF's Q4_1 kept as int4) with the same small KV
pool, waits for /health, answers one chat request, and reads the process's resident set (VmRSS) and its
peak (VmHWM) from /proc. Linux only.

    .venv/bin/python bench/memory.py [--weights float int8 auto] [--kv-cache-memory 64MiB]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_kib(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def serve_memory(weights: str, kv_cache_memory: str, timeout_s: float = 300) -> dict[str, float]:
    """Start a server with `weights`, chat once, return its resident and peak MiB."""
    port = free_port()
    command = [sys.executable, "-m", "swarmkv.cli", "serve", "--port", str(port), "--weights", weights]
    server = subprocess.Popen([*command, "--kv-cache-memory", kv_cache_memory], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the {weights} server did not come up") from None
                time.sleep(0.5)
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)["choices"][0]["message"]["content"]
        return {
            "rss_mib": proc_kib(server.pid, "VmRSS") / 1024,
            "peak_mib": proc_kib(server.pid, "VmHWM") / 1024,
            "answer": answer,
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    """Measure each format and print the table with ratios to float."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", default=["float", "int8", "auto"])
    parser.add_argument("--kv-cache-memory", default="64MiB")
    args = parser.parse_args()
    results = {w: serve_memory(w, args.kv_cache_memory) for w in args.weights}
    base = results.get("float")
    print(f"swarmkv serve, embedded SmolLM2-135M, KV pool {args.kv_cache_memory}")
    print(f"{'weights':>8} {'RSS MiB':>8} {'peak MiB':>9} {'float/this':>11}  answer")
    for weights, r in results.items():
        ratio = f"{base['rss_mib'] / r['rss_mib']:.2f}x" if base else "-"
        print(f"{weights:>8} {r['rss_mib']:>8.0f} {r['peak_mib']:>9.0f} {ratio:>11}  {r['answer']!r}")


if __name__ == "__main__":
    main()
