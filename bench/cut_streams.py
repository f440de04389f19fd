"""Streams cut before their first byte: how soon the server aborts them (issue 53).

Serves the embedded default model on loopback and first times one whole request of the same prompt length
with `max_tokens` 1 (the same run's baseline: about one prefill step, the longest a cut request in the running
step can wait for, as a step is not interrupted). Then opens N raw sockets, sends each a streamed chat request
with a long prompt and closes it before reading a byte, and watches the HTTP requests end. The figures: seconds
until every cut request ended and until the engine counted them aborted with its KV pages back to their
baseline, each also over the baseline's seconds.

    .venv/bin/python bench/cut_streams.py [--streams 16] [--prompt-words 1500]
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx

from swarmkv import LLM
from swarmkv.models.loader import load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer


def main() -> None:
    """Cut N streams and print when each was counted aborted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=1500, help="about 2,000 tokens at 1500")
    parser.add_argument("--wait-s", type=float, default=30.0)
    parser.add_argument("--cut-after-s", type=float, default=1.0, help="close the sockets this long after")
    args = parser.parse_args()
    llm = LLM(loaded=load_model(), max_model_len=4096)
    app = create_app(llm)
    ctx = app.state.ctx
    with BackgroundServer(app) as server:
        # Words no cut request's prompt starts with: no prefix of it is cached for them.
        words = " ".join(f"v{(j * 31) % 10007}" for j in range(args.prompt_words))
        start_s = time.perf_counter()
        whole = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=whole, timeout=600).status_code == 200
        one_request_s = time.perf_counter() - start_s
        baseline = ctx.engine.call(lambda engine: engine.stats()).result(120)["kv_pages_in_use"]
        socks = []
        for i in range(args.streams):
            words = " ".join(f"w{(i * 7919 + j) % 10007}" for j in range(args.prompt_words))
            body = json.dumps(
                {"messages": [{"role": "user", "content": words}], "max_tokens": 64, "stream": True}
            ).encode()
            sock = socket.create_connection(("127.0.0.1", server.port))
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            ).encode()
            sock.sendall(head + body)
            socks.append(sock)
        registry = ctx.metrics.registry

        def num_ended() -> int:
            return sum(
                int(registry.get_sample_value(
                    "swarmkv_http_requests_total", {"route": "/v1/chat/completions", "status": status}
                ) or 0)
                for status in ("200", "499")
            )  # fmt: skip

        ended_before = num_ended()  # the baseline's request; none of the cut ones yet
        time.sleep(args.cut_after_s)
        cut_s = time.perf_counter()
        for sock in socks:
            sock.close()  # before the first byte of the answer was read
        ended = 0
        while ended < args.streams and time.perf_counter() - cut_s < args.wait_s:
            ended = num_ended() - ended_before
            time.sleep(0.05)
        ended_s = time.perf_counter() - cut_s
        # The engine's own view, from its thread between two steps.
        stats = ctx.engine.call(lambda engine: engine.stats()).result(120)
        settled_s = time.perf_counter() - cut_s
        print(
            f"baseline (this run): one whole request of the same length with max_tokens 1 took {one_request_s:.2f} s; "
            f"the cut requests ended {ended_s / one_request_s:.2f}x and settled {settled_s / one_request_s:.2f}x that"
        )
        print(
            f"{args.streams} streams cut {args.cut_after_s} s after sending, before their first byte: "
            f"{ended} HTTP requests ended {ended_s:.2f} s after the cut; at the engine's next step boundary "
            f"({settled_s:.2f} s): {ctx.engine.num_aborted} counted aborted, {stats['requests_finished']} "
            f"finished (the baseline included), {stats['requests_running'] + stats['requests_waiting']} running or waiting, "
            f"{stats['kv_pages_in_use'] - baseline} pages held above the baseline, "
            f"{stats['prefill_tokens_computed']} prompt tokens computed in all"
        )


if __name__ == "__main__":
    main()
