"""How long `swarmkv lint` takes on a large request log: 1,000 requests of about 4K tokens by default.

Writes a log of N agents x T turns (tests/lint_logs.py: a timestamp on top of every system prompt, one
agent's tools reordered), then runs the command's steps in process and prints the seconds each took: the
model's tokenizer and config, the lint itself (render, breaks, both replays, the fix), and the whole. The
baseline, measured in the same run: rendering and tokenizing every request once with a fresh renderer, which any
tool reading this log through the model's template must do; the ratio says what the lint adds on top.

    .venv/bin/python bench/lint.py [--agents 50] [--turns 20] [--filler-lines 80] [--reply-lines 4]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from lint_logs import Breakers, agent_requests, write_log  # noqa: E402
from swarmkv.lint.log_file import read_log  # noqa: E402
from swarmkv.lint.model import load_lint_model  # noqa: E402
from swarmkv.lint.render import Renderer, RenderError  # noqa: E402
from swarmkv.lint.run import lint_log  # noqa: E402


def main() -> None:
    """Generate the log, lint it, print the timings."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument(
        "--filler-lines", type=int, default=80, help="extra lines in the shared system prompt"
    )
    parser.add_argument("--reply-lines", type=int, default=4, help="lines per reply and per tool result")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    breakers = Breakers(timestamp=True, tool_reorder=True)
    records = agent_requests(args.agents, args.turns, breakers, True, args.filler_lines, args.reply_lines)
    with tempfile.TemporaryDirectory() as folder:
        path = write_log(Path(folder) / "log.jsonl", records)
        start = time.perf_counter()
        model = load_lint_model(args.model)
        loaded = time.perf_counter()
        requests, _ = read_log(path)
        result = lint_log(requests, model.tokenizer, 16, model.page_bytes(16))
        done = time.perf_counter()
        renderer = Renderer(model.tokenizer)
        for request in requests:
            with contextlib.suppress(RenderError):  # the lint skips these too
                renderer.render(request)
        rendered = time.perf_counter()
    num_tokens = sum(r.prompt_tokens for r in result.requests)
    print(
        f"{len(result.requests)} requests, {num_tokens / len(result.requests):,.0f} prompt tokens on average"
    )
    print(
        f"hit rate {result.hit_rate:.3f} today, {result.projected_hit_rate:.3f} with the fix; causes {result.causes}"
    )
    print(f"model files: {loaded - start:.1f} s")
    print(f"lint:        {done - loaded:.1f} s")
    print(f"total:       {done - start:.1f} s")
    print(
        f"baseline, rendering alone: {rendered - done:.1f} s; lint / rendering: {(done - loaded) / (rendered - done):.2f}x"
    )


if __name__ == "__main__":
    main()
