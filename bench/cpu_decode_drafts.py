"""A hybrid's speculative step on the CPU: the time of one request's step of k+1 rows (its last token and k draft
tokens, its recurrent states kept after each position for the rewind) against its plain decode step of one row,
through the whole-step C decode and through the torch modules (where a hybrid's drafts ran before the C step took
them), on a Qwen3.5 GGUF, and what keeping the states costs: the C step of the same k+1 rows without keeping them,
and the rewind's copy to the first position (every linear layer's state, the most a rewind copies).

One request is prefilled to --context tokens and decoded once; the step after that is replayed from the states it
started from (restored before each replay, not timed), each variant once a repeat, in rotating order, over
--repeats; figures are medians in ms (runner.run's wall, Python included). Prints JSON.

    .venv/bin/python bench/cpu_decode_drafts.py --model bench-models/qwen35-0.8b-24L-Q4_K_M.gguf
        [--drafts 3 7] [--context 129] [--repeats 9] [--threads 2] [--float] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.core.scheduler import Chunk, StepPlan  # noqa: E402
from swarmkv.engine import cpu_decode  # noqa: E402
from swarmkv.engine.runner import ModelRunner  # noqa: E402


def recorded_step(llm: LLM, context: int) -> tuple[StepPlan, tuple[torch.Tensor, torch.Tensor]]:
    """A request prefilled to `context` tokens; its next decode step's plan and the states it started from."""
    engine = llm.engine
    runner = engine.runner
    assert runner.states is not None, "a hybrid model"
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(context)]
    engine.add_request("bench", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill and the first token
    seen: list[tuple[StepPlan, tuple[torch.Tensor, torch.Tensor]]] = []
    run = runner.run

    def record(plan: StepPlan, *rest: Any) -> Any:
        seen.append((plan, (runner.states.conv.clone(), runner.states.ssm.clone())))
        return run(plan, *rest)

    with mock.patch.object(runner, "run", record):
        engine.step()
    plan, states = seen[0]
    assert len(plan.chunks) == 1 and plan.chunks[0].kind == "decode"
    return plan, states


def variants(runner: ModelRunner, plan: StepPlan, drafts: list[int]) -> dict[str, Callable[[], float]]:
    """Each timed variant: a call that runs the step (or the rewind) once and returns its seconds."""
    chunk = plan.chunks[0]
    page_end = (chunk.start // runner.page_size + 1) * runner.page_size
    fused = runner.cpu_decode
    assert fused is not None and runner.states is not None, "the C step runs this model"
    states, slot = runner.states, plan.state_slots[chunk.request_id]

    def step(chunk: Chunk, modules: bool = False, keep: bool = True) -> Callable[[], float]:
        one = StepPlan(chunks=[chunk], state_slots=plan.state_slots)

        def run() -> float:
            runner.cpu_decode = None if modules else fused
            kept = mock.patch.object(cpu_decode, "draft_positions", lambda *_: None) if not keep else None
            try:
                if kept is not None:
                    kept.start()
                start = time.perf_counter()
                runner.run(one)
                return time.perf_counter() - start
            finally:
                if kept is not None:
                    kept.stop()
                runner.cpu_decode = fused

        return run

    out = {"C, decode": step(chunk), "modules, decode": step(chunk, modules=True)}
    for k in drafts:
        assert chunk.start + k < page_end, "draft rows past the request's last page: shorten --drafts"
        draft = tuple((chunk.token_ids[0] + 1 + j) % 1000 for j in range(k))
        spec = Chunk(chunk.seq, chunk.start, chunk.token_ids + list(draft), "decode", True, draft=draft)
        out[f"C, {k + 1} rows"] = step(spec)
        out[f"C, {k + 1} rows, states not kept"] = step(spec, keep=False)
        out[f"modules, {k + 1} rows"] = step(spec, modules=True)

        def rewind(spec: Chunk = spec) -> float:
            step(spec)()  # untimed: only the rewind's copy is
            start = time.perf_counter()
            states.rewind(slot, 1)
            return time.perf_counter() - start

        out[f"rewind to 1 of {k + 1}"] = rewind
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="a Qwen3.5 GGUF")
    parser.add_argument("--drafts", type=int, nargs="+", default=[3, 7], help="draft tokens k of a chunk")
    parser.add_argument("--context", type=int, default=129, help="prompt tokens before the timed step")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--float", action="store_true", help="float32 activations (cpu_int8_activations off)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(str(args.model), speculation="off", prefix_caching=False, cpu_int8_activations=not args.float)
    runner = llm.engine.runner
    plan, before = recorded_step(llm, args.context)
    assert runner.states is not None
    timed = variants(runner, plan, args.drafts)
    samples: dict[str, list[float]] = {name: [] for name in timed}
    names = list(timed)
    for rep in range(args.repeats + 1):  # the first round warms up
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            runner.states.conv.copy_(before[0])
            runner.states.ssm.copy_(before[1])
            seconds = timed[name]()
            if rep:
                samples[name].append(seconds * 1e3)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    result = {
        "model": str(args.model),
        "threads": args.threads,
        "int8_activations": not args.float,
        "context": args.context,
        "median_ms": medians,
        "against_C_decode": {name: m / medians["C, decode"] for name, m in medians.items()},
        "samples_ms": samples,
    }
    for name, m in medians.items():
        print(f"{name:36s} {m:8.1f} ms  {m / medians['C, decode']:5.2f}x C decode")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
