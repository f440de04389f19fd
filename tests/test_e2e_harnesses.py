"""Claude Code, Codex CLI and Qwen Code, the npm releases tests/harnesses.py pins, against `swarmkv serve`.

Eight instances of each harness run one non-interactive task each, at once, in worktrees of one project,
configured as the README's recipes say, against one server with default flags. The model is the scripted checkpoint on the Qwen3 vocabulary (tests/scripted_model.py): its greedy
reply is a `get_weather` call, then "It is sunny in Paris." once the tool's result is back, so each run
makes one tool round trip (the harness has no such tool and answers with an error result, which is a
result all the same). The harnesses' own answers, as received through a recording proxy, say what each
request read from the cache (usage), and the server's request log what its prefix cache served each request,
by the request id its answer's `X-Request-Id` header names.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from harnesses import (
    CLAUDE_CODE,
    CODEX,
    HARNESSES,
    QWEN_CODE,
    Harness,
    Instance,
    Run,
    Server,
    make_workspaces,
    missing,
    prompt_split,
    prompt_usage,
    run_one,
    swarmkv_serve,
)
from scripted_model import ANSWER, make_scripted_checkpoint
from swarmkv.lint.log_file import read_log_file

pytestmark = pytest.mark.e2e

# Eight instances at once, each in its own worktree of one project (the founding document's swarm).
NUM_INSTANCES = 8
# Instances 2-8's first request, read from the cache as the server counts it: the median's target and every
# instance's (issue 55). Claude Code 2.1.332's first request has 11.7K tokens, and the first text that differs
# between two worktrees is the git branch in its first user turn, at 74-79% of it; Codex's first request
# differs only near its end; Qwen Code's shares its tools and system prompt under the default tools-first
# layout.
SHARED_TARGET = {CLAUDE_CODE: (0.73, 0.65), CODEX: (0.95, 0.90), QWEN_CODE: (0.70, 0.65)}
# The positions a harness's prompt and its clamped max_tokens need: prompts are 7K-25K Qwen3 tokens.
MAX_POSITIONS = 65536


@pytest.fixture(scope="module", autouse=True)
def harnesses_installed() -> None:
    reason = missing()
    if reason is not None:
        if os.environ.get("SWARMKV_E2E_REQUIRED"):
            pytest.fail(f"SWARMKV_E2E_REQUIRED is set but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """`serve(arch)`: a `swarmkv serve` of the scripted checkpoint, started once per module and kind, with the
    default flags but these two."""
    root = tmp_path_factory.mktemp("e2e-serve")
    servers: dict[str, Server] = {}
    with ExitStack() as stack:

        def get(arch: str = "llama") -> Server:
            if arch not in servers:
                model = root / f"scripted-{arch}"
                make_scripted_checkpoint(model, vocabulary="qwen3", arch=arch, max_positions=MAX_POSITIONS)  # type: ignore[arg-type]
                # The scripted model calls get_weather, which no harness offers: under a grammar it would be
                # forced into another tool with made-up arguments, and the harness's reaction to those is
                # not what these tests are about (tests/test_structured*.py hold the grammar to its schemas).
                # The request log is where the server says what its prefix cache served each request.
                flags = ["--tool-call-grammar", "strict"]
                log = root / f"requests-{arch}.jsonl"
                servers[arch] = stack.enter_context(swarmkv_serve(model, root, *flags, request_log=log))
            return servers[arch]

        yield get


def _check_run(run: Run) -> list[tuple[int, int]]:
    """A run that exits 0 with every request 2xx, makes one tool round trip and ends with the answer.

    Returns each generation's (prompt tokens read from cache, prompt tokens).
    """
    assert run.returncode == 0, run.describe()
    assert all(200 <= e.status < 300 for e in run.exchanges), run.describe()
    generations = run.generations
    assert len(generations) >= 2, run.describe()
    call, result = _tool_round_trip(run.harness)
    first_call = next(i for i, e in enumerate(generations) if call in e.response)
    assert any(result(e.body) for e in generations[first_call + 1 :]), run.describe()
    assert ANSWER in run.stdout, run.describe()
    return [prompt_usage(e) for e in generations]


def _tool_round_trip(harness: Harness) -> tuple[str, Callable[[dict[str, object]], bool]]:
    """What the model's call looks like in the answer, and how a later request carries its result."""

    def has(kind: str, items: object) -> bool:
        return isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == kind for i in items)

    if harness is CLAUDE_CODE:
        return '"tool_use"', lambda body: any(has("tool_result", m.get("content")) for m in body["messages"])  # type: ignore[attr-defined]
    if harness is CODEX:
        return '"function_call"', lambda body: has("function_call_output", body["input"])
    return '"tool_calls"', lambda body: any(m.get("role") == "tool" for m in body["messages"])  # type: ignore[attr-defined]


def _ids(run: Run) -> list[str]:
    """The engine request ids of a run's generations, in the order they were sent."""
    return [e.headers["x-request-id"] for e in run.generations]


def _report(label: str, usage: list[tuple[int, int]]) -> str:
    parts = [f"{read:,}/{total:,} ({read / total:.0%})" for read, total in usage]
    line = f"{label}: cache read per request: " + ", ".join(parts)
    print(line)
    return line


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda h: h.name)
def test_the_installed_release_is_the_pinned_one(harness: Harness) -> None:
    env = harness.env("http://127.0.0.1:9", Path("/nonexistent"))
    out = subprocess.run(harness.version_argv(), capture_output=True, text=True, timeout=120, env=env)
    assert harness.version in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda h: h.name)
def test_eight_instances_at_once_share_their_head(
    harness: Harness, serve: Callable[..., Server], tmp_path: Path
) -> None:
    server = serve()
    home = tmp_path / "home"  # one user's
    instances = []
    for workspace in make_workspaces(tmp_path, NUM_INSTANCES):
        instances.append(Instance(harness, server.port, workspace, home))
        time.sleep(0.2)
    runs = [instance.wait() for instance in instances]
    for run in runs:
        usage = _check_run(run)
        # Its second request reads its first from the cache: all of it but the reply's own last tokens.
        (_, first_prompt), (second_read, _) = usage[0], usage[1]
        assert second_read >= 0.9 * first_prompt, usage

    # What the server's prefix cache served each request, by the request id its answer names.
    assert server.request_log is not None
    served = {e.request_id: e for e in read_log_file(server.request_log).ended}
    lines = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    admitted = [line["request_id"] for line in lines if "body" in line]  # logged once queued, in order
    generations = [e for run in runs for e in run.generations]
    ids = [e.headers.get("x-request-id", "") for e in generations]
    assert all(i in served for i in ids), [i for i in ids if i not in served]

    # Usage is consistent: per request, its split adds up to the prompt the server ran, and what it says was
    # read or created is what the server's cache served it, split as the server did: a Messages request's
    # pins computed what it created; what it read was there before it. Over the run, the reads (Messages: and
    # creations, which are prefix hits of the request too) are the server's hits. (Not /metrics's counter,
    # which counts a session's later turn only for the positions its session had not processed.)
    for exchange, request_id in zip(generations, ids, strict=True):
        split, end = prompt_split(exchange), served[request_id]
        assert split.read + split.created + split.uncached == split.prompt == end.prompt_tokens, (split, end)
        assert (split.read, split.created) == (end.read_tokens, end.pin_computed_tokens), (split, end)
    reads = sum(prompt_split(e).read + prompt_split(e).created for e in generations)
    assert reads == sum(served[i].cached_tokens for i in ids)
    firsts = [run.generations[0].headers["x-request-id"] for run in runs]

    # One instance computes the head and the seven others read it: the first is the one whose first request the
    # server computed the most of (a Messages request's pins included), the others in the order their first
    # requests were logged. Logged order is not admission order: a line is written off the event loop, and a
    # Messages request's marks are pinned in turn before it is admitted. If two computed the head, the second
    # is among the seven and fails the targets below.
    by_log = sorted(range(NUM_INSTANCES), key=lambda i: admitted.index(firsts[i]))
    creator = max(by_log, key=lambda i: served[firsts[i]].prompt_tokens - served[firsts[i]].read_tokens)
    order = [creator] + [i for i in by_log if i != creator]
    for rank, i in enumerate(order):
        usage = [(served[r].read_tokens, served[r].prompt_tokens) for r in _ids(runs[i])]
        _report(f"{harness.name} {harness.version} x{NUM_INSTANCES}, instance {rank + 1} (server)", usage)
    shares = [served[firsts[i]].read_tokens / served[firsts[i]].prompt_tokens for i in order[1:]]
    median, least = statistics.median(shares), min(shares)
    print(
        f"{harness.name} instances 2-{NUM_INSTANCES}, first request read: median {median:.1%}, min {least:.1%}"
    )
    median_target, every_target = SHARED_TARGET[harness]
    assert median >= median_target and least >= every_target, [f"{share:.1%}" for share in shares]


def test_a_harness_runs_on_a_hybrid_model(serve: Callable[..., Server], tmp_path: Path) -> None:
    # Qwen3.5's architecture (Gated DeltaNet layers with recurrent state, and full attention).
    harness = CODEX
    server = serve(arch="qwen3_5")
    (project,) = make_workspaces(tmp_path, 1)
    usage = _check_run(run_one(harness, server.port, project, tmp_path / "home"))
    _report(f"{harness.name} on a Qwen3.5 hybrid", usage)
    (_, first_prompt), (second_read, _) = usage[0], usage[1]
    assert second_read >= 0.9 * first_prompt, usage
