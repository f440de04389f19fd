"""Streams cut before their first byte: how soon the server aborts them (issue 53).

Serves the embedded default model on loopback, once for each `--max-step-s` value (`ServerConfig.max_step_s`:
0 is the token budget alone, steps of up to 2,048 prompt tokens; 1 caps a step's tokens to what the measured
prefill speed computes in a second), and in each first times one whole request of the same prompt length with
`max_tokens` 1 (the same run's baseline, and the prefill's cost under that setting). Then it opens N raw
sockets, sends each a streamed chat request with a long prompt, closes them `--cut-after-s` later before
reading a byte, and watches the HTTP requests end. The figures: seconds until every cut request ended, and
until the engine, at its next step boundary, counted them aborted with its KV pages back to their baseline
(what an abort waits for is the step running when it came); the longest step seen meanwhile.

    .venv/bin/python bench/cut_streams.py [--streams 16] [--prompt-words 400] [--max-step-s 0,1]
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx

from swarmkv import LLM
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer


def cut_streams(loaded: LoadedModel, args: argparse.Namespace, max_step_s: float) -> str:
    """One server with `max_step_s`: the baseline request, then N streams cut; its figures, one line."""
    llm = LLM(loaded=loaded, max_model_len=4096)
    config = ServerConfig(max_step_s=max_step_s)
    app = create_app(llm, config)
    ctx = app.state.ctx
    engine = llm.engine
    steps_s: list[float] = []
    step = engine.step

    def timed_step() -> list:  # type: ignore[type-arg]
        start_s = time.perf_counter()
        try:
            return step()
        finally:
            steps_s.append(time.perf_counter() - start_s)

    engine.step = timed_step  # type: ignore[method-assign]
    with BackgroundServer(app, limits=config) as server:
        # Words no cut request's prompt starts with: no prefix of it is cached for them.
        words = " ".join(f"v{(j * 31) % 10007}" for j in range(args.prompt_words))
        start_s = time.perf_counter()
        whole = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=whole, timeout=600)
        assert answer.status_code == 200, answer.text
        num_prompt_tokens = answer.json()["usage"]["prompt_tokens"]
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
        num_steps_before = len(steps_s)
        cut_s = time.perf_counter()
        for sock in socks:
            sock.close()  # before the first byte of the answer was read
        ended = 0
        while ended < args.streams and time.perf_counter() - cut_s < args.wait_s:
            ended = num_ended() - ended_before
            time.sleep(0.05)
        ended_s = time.perf_counter() - cut_s
        # The engine's own view, from its thread between two steps.
        stats = ctx.engine.call(lambda engine: engine.stats()).result(600)
        settled_s = time.perf_counter() - cut_s
        longest_step_s = max(steps_s[num_steps_before - 1 :], default=0.0)
    return (
        f"--max-step-s {max_step_s:g}: one whole request ({num_prompt_tokens} prompt tokens, max_tokens 1) "
        f"{one_request_s:.2f} s; {args.streams} streams cut {args.cut_after_s} s after sending: {ended} HTTP "
        f"requests ended {ended_s:.2f} s after the cut, the engine settled at {settled_s:.2f} s (longest step "
        f"running meanwhile {longest_step_s:.2f} s): {ctx.engine.num_aborted} counted aborted, "
        f"{stats['requests_running'] + stats['requests_waiting']} running or waiting, "
        f"{stats['kv_pages_in_use'] - baseline} pages held above the baseline, "
        f"{stats['prefill_tokens_computed']} prompt tokens computed in all"
    )


def main() -> None:
    """Cut N streams under each --max-step-s and print when each was counted aborted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=400, help="about 2,000 tokens at 400")
    parser.add_argument("--wait-s", type=float, default=60.0)
    parser.add_argument("--cut-after-s", type=float, default=1.0, help="close the sockets this long after")
    parser.add_argument("--max-step-s", default="0,1", help="comma-separated ServerConfig.max_step_s values")
    args = parser.parse_args()
    loaded = load_model()
    lines = [cut_streams(loaded, args, float(value)) for value in args.max_step_s.split(",")]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
