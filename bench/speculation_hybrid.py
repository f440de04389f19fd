"""Speculative decoding on a hybrid (issue 29, item 5): speculation on against off on a Qwen3.5-shaped model
on the CPU, in the same run: decode tokens/s, tokens per verification step, acceptance, and the cost of one
verification step against one decode step.

The model is bench/hybrid.py's random Qwen3.5 text model (8 layers, 3 Gated DeltaNet to 1 attention, hidden
512, the Qwen3 vocabulary), float32. A random model copies nothing of its own accord, so the copy workload
hands it text to copy the way a swarm does: a first request's reply R to a prompt P is kept, and the timed
request, P + R[:16] under the same head and salt, continues exactly as R did, which the drafter proposes from
that sibling's reply (every draft accepted while its state stays exact). The diverge workload changes one
token of P halfway through before appending R[:16]: the drafter proposes R's continuation as before, but the
reply soon parts from R, so it prices rejected drafts and the drafter's back-off. The control workload is a
fresh random prompt under its own salt: nothing to draft from but its own context, which a random model
rarely repeats (speculation on should cost nothing there). With --model, a GGUF runs instead (a Qwen3.5 file
at its own bits, bench-models/qwen35-0.8b-24L-Q4_K_M.gguf: the whole-step C decode takes its decodes and, since it
runs a hybrid's speculative chunks, its verification steps too).

Each timed request is stepped by hand: its first step (the prefill and first token) is left out, every later
step is timed. Decode tokens/s is the tokens after the first over those steps' time; a verification step is
one that verified a draft, a decode step one of the run with speculation off. On and off alternate, order
swapped each repeat, and each figure is the best (tokens/s) or the median (step times) over --repeats; greedy
identity on against off is checked on every run. Prints JSON.

    .venv/bin/python bench/speculation_hybrid.py [--prompt-tokens 128] [--max-tokens 48] [--repeats 3]
        [--threads 1] [--model a.gguf] [--float] [--workloads copy diverge control] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.engine.engine import LLMEngine  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model  # noqa: E402

MODES = ("off", "on")
WORKLOADS = ("copy", "diverge", "control")
COPIED_TOKENS = 16

_ids = itertools.count()


@dataclass
class Run:
    """One timed request: its reply, each timed step's seconds and what it verified, and the spec counters."""

    token_ids: list[int]
    step_s: list[float] = field(default_factory=list)
    step_drafts: list[int] = field(default_factory=list)  # draft tokens each timed step verified (0: none)
    step_tokens: list[int] = field(default_factory=list)  # tokens each timed step yielded
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first step over the timed steps' seconds."""
        return sum(self.step_tokens) / sum(self.step_s)


SPEC_KEYS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_sibling_tokens")


def timed_request(engine: LLMEngine, prompt: list[int], params: SamplingParams, salt: str) -> Run:
    """Run one request alone, timing every step after its first."""
    rid = f"bench-{next(_ids)}"
    c = engine.counters
    before = {k: getattr(c, k) for k in SPEC_KEYS}
    engine.add_request(rid, prompt, params, cache_salt=salt)
    tokens = [t for d in engine.step() for t in d.new_token_ids]
    run = Run(tokens)
    while engine.has_unfinished():
        drafted = c.spec_draft_tokens
        start = time.perf_counter()
        deltas = engine.step()
        run.step_s.append(time.perf_counter() - start)
        new = [t for d in deltas for t in d.new_token_ids]
        run.step_drafts.append(c.spec_draft_tokens - drafted)
        run.step_tokens.append(len(new))
        tokens.extend(new)
    run.counters = {k: getattr(c, k) - before[k] for k in SPEC_KEYS}
    return run


def workload_prompt(
    engine: LLMEngine, name: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], str]:
    """The timed prompt of a workload and its salt; for `copy` and `diverge`, after the sibling whose reply
    it is drafted from."""
    salt = f"hybrid-spec-{next(_ids)}"
    if name == "control":
        return prompt, salt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens + COPIED_TOKENS, ignore_eos=True)
    reply = timed_request(engine, prompt, params, salt).token_ids
    timed = list(prompt)
    if name == "diverge":
        timed[len(timed) // 2] = (timed[len(timed) // 2] + 1) % (max(prompt) + 1)
    return timed + reply[:COPIED_TOKENS], salt


def make_engines(loaded: LoadedModel, **options: Any) -> dict[str, LLMEngine]:
    """An engine with speculation off and one with it on (torch backend), over the same weights."""
    common: dict[str, Any] = {"kv_cache_memory": "256MiB", **options}
    return {mode: LLM(loaded=loaded, speculation=mode, **common).engine for mode in MODES}


def measure(
    engines: dict[str, LLMEngine],
    prompt_tokens: int,
    max_tokens: int,
    repeats: int,
    vocab: int,
    workloads: tuple[str, ...] = WORKLOADS,
) -> dict[str, Any]:
    """Every workload, on and off alternating, over `repeats`: per workload the figures (see the docstring)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    for engine in engines.values():  # warm-up
        timed_request(engine, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "w")
    out: dict[str, Any] = {}
    for name in workloads:
        start = time.perf_counter()
        runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
        for rep in range(repeats):
            prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                engine = engines[mode]
                timed, salt = workload_prompt(engine, name, prompt, max_tokens)
                runs[mode].append(timed_request(engine, timed, params, salt))
        out[name] = summarise(runs, repeats)
        out[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {out[name]['seconds']} s", file=sys.stderr, flush=True)
    return out


def summarise(runs: dict[str, list[Run]], repeats: int) -> dict[str, Any]:
    """One workload's figures from its runs on and off."""
    counters = {k: sum(r.counters[k] for r in runs["on"]) for k in SPEC_KEYS}
    verify_s = [s for r in runs["on"] for s, d in zip(r.step_s, r.step_drafts, strict=True) if d]
    verify_drafts = [d for r in runs["on"] for d in r.step_drafts if d]
    decode_s = [s for r in runs["off"] for s in r.step_s]
    rates = {mode: max(r.decode_tok_s for r in runs[mode]) for mode in MODES}
    steps = counters["spec_verify_steps"]
    verify_median = statistics.median(verify_s) if verify_s else None
    decode_median = statistics.median(decode_s)
    return {
        "repeats": repeats,
        "generated": len(runs["on"][0].token_ids),
        "identical": all(a.token_ids == b.token_ids for a, b in zip(runs["on"], runs["off"], strict=True)),
        "decode_tok_s": rates,
        "speedup": rates["on"] / rates["off"],
        "counters": counters,
        "tokens_per_verify_step": (counters["spec_accepted_tokens"] + steps) / steps if steps else None,
        "acceptance": counters["spec_accepted_tokens"] / counters["spec_draft_tokens"]
        if counters["spec_draft_tokens"]
        else None,
        "mean_draft_tokens": statistics.mean(verify_drafts) if verify_drafts else None,
        "verify_step_ms": 1e3 * verify_median if verify_median is not None else None,
        "decode_step_ms": 1e3 * decode_median,
        "verify_over_decode_step": verify_median / decode_median if verify_median is not None else None,
        "steps": {mode: sum(len(r.step_s) for r in runs[mode]) for mode in MODES},
    }


def main() -> None:
    """Build the model, measure every workload on and off, print JSON."""
    from hybrid import SMALL_SHAPE, build_checkpoint  # bench/hybrid.py, beside this script

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: on a 2-core machine shared with other work, a second one's spinning tripled step times.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None, help="a hybrid GGUF (default: the random model)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    # A GGUF's decodes read int8 activations by default, its prefills float32 ones: the copy workload's
    # prompt (the sibling's reply prefilled) then leaves a state the reply's decodes did not, and it parts.
    parser.add_argument("--float", action="store_true", help="float32 activations in the C step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is not None:
        loaded = load_model(args.model)
        model: Any = str(args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            build_checkpoint(Path(tmp))
            loaded = load_model(Path(tmp), dtype="float32")
        model = {k: SMALL_SHAPE[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    start = time.perf_counter()
    engines = make_engines(loaded, **({"cpu_int8_activations": False} if args.float else {}))
    print(f"C decode step: {engines['on'].runner.cpu_decode is not None}", file=sys.stderr, flush=True)
    results = measure(
        engines,
        args.prompt_tokens,
        args.max_tokens,
        args.repeats,
        loaded.config.vocab_size,
        tuple(args.workloads),
    )
    report = {
        "model": model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": args.threads,
        "int8_activations": args.model is not None and not args.float,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seconds": round(time.perf_counter() - start, 1),
        "workloads": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
