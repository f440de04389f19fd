"""Speculative decoding on agentic decode workloads (issue 29, item 7): tokens per verification step,
acceptance, and wall decode tokens/s against speculation off in the same run, on the CPU.

Workloads, chat prompts from the committed bench/speculation_prompts.json, greedy (temperature 0):
- file_edit: a ~50-line Python file in the prompt, "rewrite it with `foo` renamed to `bar`" (batch 1);
- tool_call: a tool schema in the system prompt, five paths in the user message to read_file (batch 1);
- swarm: 8 agents with the same system prompt and tools (one head: same salt, same opening tokens) and
  different short tasks leading to similar calls, as one batch. The prompt set's tool_choice "required"
  puts each reply under the tools' grammar, as a harness forcing a call does: it writes Hermes calls
  (`<tool_call>` JSON blocks), the grammar's forced runs (jump-forward) and drafts alike. In lockstep no agent is ever ahead of another,
  so a sibling can only lend text it wrote at an earlier position of its reply;
- swarm_staggered: the same 8 agents arriving one every --stagger-steps engine steps (8 by default), as a
  swarm's agents reach the server apart: an agent that arrives later can draft from the replies of those ahead
  of it. The share of accepted tokens drafted from siblings' replies is its figure (the target's row). A
  third engine, on with siblings' replies no source (`draft_sources` without sibling), runs it once a repeat:
  the accepted tokens with siblings against without say what siblings add beyond the agent's own text;
- prose: "a short story about a lighthouse keeper", the control (little to draft from).
The model's own greedy output is what gets drafted; no draft model.

Decode time excludes prefill as bench/decode.py does: the time of a run to --max-tokens less that of a run
to 1 token of the same prompts, (generated - rows) tokens over the difference. Prefix caching is off, and
every measured run takes a fresh cache salt, so an earlier run's reply is never a sibling draft source for
a batch-1 workload (the drafter scopes siblings by salt); within the swarm's batch the 8 share one salt.
Runs are interleaved (workload by workload, on/off order alternating each repeat) over --repeats. Each
repeat's 1-token run follows its long run, and a repeat's decode rate takes the two together: the 1-token
run's time moves between repeats (0.25 to 0.44 s for the file edit in one sitting), so a long run less a
short run of another repeat would misstate the decode. Each figure is the best repeat's rate; the median's
ratio is reported beside it. Greedy identity compares every run's tokens on against off; it is exact only on
float32 math, so beside the default engine (the C decode step on int8-quantised activations) a pair of
engines with `cpu_int8_activations=False` checks it once per workload (--no-float-check skips it). Beside
other load on a 2-core machine, timings swing: compare the samples in --json, or raise --repeats.

    .venv/bin/python bench/speculation.py [--max-tokens 192] [--repeats 3] [--threads 2]
        [--workloads file_edit tool_call swarm prose] [--json spec.json] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.api.structured_request import special_markup  # noqa: E402
from swarmkv.choices import DRAFT_SOURCES  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model, resolve_model_path  # noqa: E402
from swarmkv.structured.grammars import tool_call_grammar  # noqa: E402
from swarmkv.tokenizer import Tokenizer  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "speculation_prompts.json"
WORKLOADS = ("file_edit", "tool_call", "swarm", "swarm_staggered", "prose")
STAGGERED = "swarm_staggered"  # the swarm's prompts, arriving apart
MODES = ("off", "on")
NO_SIBLINGS = "on_no_siblings"  # swarm_staggered only: speculation on, siblings' replies no source
TARGET_TOKENS_PER_STEP = 2.5  # file_edit
TARGET_SPEEDUP = 1.8  # file_edit, batch 1
TARGET_SIBLING_SHARE = 0.30  # swarm_staggered: accepted tokens drafted from siblings
TARGET_CONTROL = 0.97  # prose against off

_salts = itertools.count()


def load_entries(path: Path = PROMPTS) -> dict[str, dict[str, Any]]:
    """Each workload's entry of the prompt set (the staggered swarm shares the swarm's)."""
    data = json.loads(path.read_text())
    return {name: data["swarm" if name == STAGGERED else name] for name in WORKLOADS}


def load_prompts(path: Path = PROMPTS) -> dict[str, list[list[dict[str, str]]]]:
    """Each workload's chat prompts (lists of messages): one for the batch-1 workloads, 8 for the swarm."""
    out: dict[str, list[list[dict[str, str]]]] = {}
    for name, entry in load_entries(path).items():
        if "tasks" in entry:
            system = {"role": "system", "content": entry["system"]}
            out[name] = [[system, {"role": "user", "content": task}] for task in entry["tasks"]]
        else:
            out[name] = [entry["messages"]]
    return out


def load_grammars(tokenizer: Tokenizer, path: Path = PROMPTS) -> dict[str, str | None]:
    """Each workload's reply grammar: its tools' Hermes calls where the prompt set forces a call
    (tool_choice "required"), else None."""
    out: dict[str, str | None] = {}
    special = special_markup(tokenizer)
    for name, entry in load_entries(path).items():
        if entry.get("tool_choice") == "required":
            functions = [tool["function"] for tool in entry["tools"]]
            out[name] = tool_call_grammar(functions, "hermes", free_text=False, special=special)
        else:
            out[name] = None
    return out


@dataclass
class Run:
    """One `generate` of a workload's prompts: seconds, each row's tokens, and the spec counters it moved."""

    seconds: float
    token_ids: list[list[int]]
    counters: dict[str, int]

    @property
    def generated(self) -> int:
        """Tokens generated over every row."""
        return sum(len(t) for t in self.token_ids)


SPEC_KEYS = (
    "steps",
    "spec_verify_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_accepted_sibling_tokens",
    "spec_accepted_session_tokens",
)


def run_once(
    llm: LLM,
    prompts: list[list[dict[str, str]]],
    max_tokens: int,
    stagger_steps: int = 0,
    grammar: str | None = None,
) -> Run:
    """One greedy run of every prompt under a fresh shared salt (so no earlier run drafts for it): one
    `generate`, or with `stagger_steps` prompt i added to the engine after i x stagger_steps of its steps."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)
    salt = f"spec-bench-{next(_salts)}"
    before = llm.engine.stats()
    start = time.perf_counter()
    if stagger_steps:
        token_ids = staggered(llm, prompts, params, salt, stagger_steps)
    else:
        outputs = llm.generate(prompts, params, cache_salt=salt)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        token_ids = [list(o.token_ids) for o in outputs]
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    counters = {k: int(after[k]) - int(before[k]) for k in SPEC_KEYS}
    return Run(seconds, token_ids, counters)


def staggered(
    llm: LLM, prompts: list[list[dict[str, str]]], params: SamplingParams, salt: str, stagger_steps: int
) -> list[list[int]]:
    """Each prompt's reply tokens, prompt i added to the engine once it has run i x stagger_steps steps."""
    engine, ids = llm.engine, [llm.encode_prompt(p) for p in prompts]  # type: ignore[arg-type]
    rids = [f"{salt}-{i}" for i in range(len(ids))]
    replies: dict[str, list[int]] = {rid: [] for rid in rids}
    steps = added = 0
    while added < len(ids) or engine.has_unfinished():
        while added < len(ids) and steps >= added * stagger_steps:
            engine.add_request(rids[added], ids[added], params, cache_salt=salt)
            added += 1
        for delta in engine.step():
            assert delta.error is None, delta.error
            replies[delta.request_id] += delta.new_token_ids
        steps += 1
    return [replies[rid] for rid in rids]


def decode_tok_s(long: Run, short_s: float) -> float | None:
    """Decode tokens/s of `long` less a 1-token run: (generated - rows) over the time difference."""
    extra_s = long.seconds - short_s
    tokens = long.generated - len(long.token_ids)
    return tokens / extra_s if extra_s > 0 and tokens > 0 else None


def make_llms(
    loaded: LoadedModel, max_tokens: int, no_siblings: bool = False, method: str = "text", **options: Any
) -> dict[str, LLM]:
    """An engine with speculation off and one with it on, over the same weights; with `no_siblings` also one
    on whose drafts come from everything but siblings (NO_SIBLINGS: what siblings add)."""
    common: dict[str, Any] = {"prefix_caching": False, "max_num_seqs": 8, **options}
    budget = 8 * (2048 + max_tokens) * loaded.config.kv_bytes_per_token(loaded.dtype)
    common.setdefault("kv_cache_memory", int(budget * 1.25))
    # The engine with speculation on drafts by `method` (text, mtp or both: a Qwen3.5 file's MTP layer).
    llms = {mode: LLM(loaded=loaded, speculation=mode, speculative_method=method, **common) for mode in MODES}
    if no_siblings:
        sources = tuple(s for s in DRAFT_SOURCES if s != "sibling")
        llms[NO_SIBLINGS] = LLM(loaded=loaded, speculation="on", draft_sources=sources, **common)
    return llms


def measure(
    llms: dict[str, LLM],
    prompts: dict[str, list[list[dict[str, str]]]],
    workloads: list[str],
    max_tokens: int,
    repeats: int,
    stagger_steps: int = 8,
    grammars: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Every workload's runs, interleaved, on and off; per workload the best samples, the counters of the
    runs with speculation on summed, and whether every run's tokens on matched off's."""
    for llm in llms.values():  # warm-up: one short run each
        run_once(llm, prompts[workloads[0]][:1], 4)
    long_s: dict[tuple[str, str], list[float]] = defaultdict(list)
    short_s: dict[tuple[str, str], list[float]] = defaultdict(list)
    runs: dict[tuple[str, str], list[Run]] = defaultdict(list)
    grammars = grammars or {}
    for rep in range(repeats):
        for name in workloads:
            stagger, grammar = stagger_steps if name == STAGGERED else 0, grammars.get(name)
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                run = run_once(llms[mode], prompts[name], max_tokens, stagger, grammar)
                runs[name, mode].append(run)
                long_s[name, mode].append(run.seconds)
                short_s[name, mode].append(run_once(llms[mode], prompts[name], 1, stagger, grammar).seconds)
            if name == STAGGERED and NO_SIBLINGS in llms:
                runs[name, NO_SIBLINGS].append(
                    run_once(llms[NO_SIBLINGS], prompts[name], max_tokens, stagger, grammar)
                )
    out: dict[str, Any] = {}
    for name in workloads:
        on_runs, off_runs = runs[name, "on"], runs[name, "off"]
        counters = {k: sum(r.counters[k] for r in on_runs) for k in SPEC_KEYS}
        rates, medians = {}, {}
        for mode in MODES:
            paired = [
                decode_tok_s(run, short)
                for run, short in zip(runs[name, mode], short_s[name, mode], strict=True)
            ]
            measured = sorted(r for r in paired if r is not None)
            rates[mode] = measured[-1] if measured else None
            medians[mode] = statistics.median(measured) if measured else None
        alone = runs.get((name, NO_SIBLINGS), [])
        identical = all(a.token_ids == off_runs[0].token_ids for a in on_runs + off_runs + alone)
        accepted = counters["spec_accepted_tokens"]
        accepted_alone = sum(r.counters["spec_accepted_tokens"] for r in alone) if alone else None
        out[name] = {
            "rows": len(prompts[name]),
            "generated": on_runs[0].generated,
            "identical": identical,
            "counters": counters,
            "tokens_per_step": tokens_per_step(counters),
            "acceptance": share(accepted, counters["spec_draft_tokens"]),
            "sibling_share": share(counters["spec_accepted_sibling_tokens"], accepted),
            # accepted tokens with every source against without siblings': what siblings add, net of the
            # drafts their text displaced (the share above also counts a draft the own context offered too,
            # when the sibling's match was the longer)
            "accepted_no_siblings": accepted_alone,
            "siblings_add": None if accepted_alone is None else share(accepted - accepted_alone, accepted),
            "decode_tok_s": rates,
            "speedup": ratio(rates["on"], rates["off"]),
            "median_speedup": ratio(medians["on"], medians["off"]),
            "samples": {
                mode: {"long_s": long_s[name, mode], "short_s": short_s[name, mode]} for mode in MODES
            },
            "text": llms["on"].tokenizer.decode(on_runs[0].token_ids[0]),
        }
    return out


def identity_check(
    llms: dict[str, LLM],
    prompts: dict[str, list[list[dict[str, str]]]],
    workloads: list[str],
    max_tokens: int,
    stagger_steps: int = 8,
    grammars: dict[str, str | None] | None = None,
) -> dict[str, bool]:
    """Per workload, whether one greedy run's tokens with speculation on equal off's."""
    stagger = {name: stagger_steps if name == STAGGERED else 0 for name in workloads}
    grammars = grammars or {}

    def tokens(mode: str, name: str) -> list[list[int]]:
        return run_once(llms[mode], prompts[name], max_tokens, stagger[name], grammars.get(name)).token_ids

    return {name: tokens("on", name) == tokens("off", name) for name in workloads}


def tokens_per_step(counters: dict[str, int]) -> float | None:
    """Tokens a verification step yielded on average (accepted drafts plus the one it always yields)."""
    steps = counters["spec_verify_steps"]
    return (counters["spec_accepted_tokens"] + steps) / steps if steps else None


def share(part: int, whole: int) -> float | None:
    """part / whole, or None when whole is 0."""
    return part / whole if whole else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A figure as printed, or '-' when missing."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or '-' for a figure that could not be measured."""
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def at_least(value: float | None, target: float) -> bool | None:
    """Whether a measured value meets its target; None when it is missing."""
    return None if value is None else value >= target


def report(results: dict[str, Any], float_identity: dict[str, bool] | None) -> list[str]:
    """The table and the PASS/FAIL lines."""
    lines = [
        f"{'workload':<15} {'rows':>4} {'tokens':>6} {'identical':>9} {'tok/step':>8} {'accept':>7} "
        f"{'sibling':>7} {'off tok/s':>9} {'on tok/s':>9} {'on/off':>7} {'median':>7}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<15} {r['rows']:>4} {r['generated']:>6} {str(r['identical']):>9} "
            f"{fmt(r['tokens_per_step']):>8} {fmt(r['acceptance'], '.0%'):>7} {fmt(r['sibling_share'], '.0%'):>7} "
            f"{fmt(r['decode_tok_s']['off'], '.1f'):>9} {fmt(r['decode_tok_s']['on'], '.1f'):>9} "
            f"{fmt(r['speedup'], '.2f', 'x'):>7} {fmt(r['median_speedup'], '.2f', 'x'):>7}"
        )
    lines.append("")
    for name, r in results.items():
        if r.get("accepted_no_siblings") is not None:
            lines.append(
                f"{name}: {r['counters']['spec_accepted_tokens']} accepted draft tokens with siblings' replies "
                f"as a source, {r['accepted_no_siblings']} without: siblings add {fmt(r['siblings_add'], '.0%')}"
            )
    same = all(r["identical"] for r in results.values())
    lines.append(
        f"{verdict(same)}  greedy output on == off, every workload, default engine (int8 activations)"
    )
    if float_identity is not None:
        lines.append(
            f"{verdict(all(float_identity.values()))}  greedy output on == off, every workload, "
            f"float32 activations: {float_identity}"
        )
    checks = [
        ("file_edit", "tokens_per_step", TARGET_TOKENS_PER_STEP, "tokens per verification step, file_edit"),
        ("file_edit", "speedup", TARGET_SPEEDUP, "decode wall speedup on/off, file_edit, batch 1"),
        (
            STAGGERED,
            "sibling_share",
            TARGET_SIBLING_SHARE,
            "swarm of 8 arriving apart: accepted tokens from siblings",
        ),
        ("prose", "speedup", TARGET_CONTROL, "prose (control) decode on/off"),
    ]
    for name, key, target, label in checks:
        if name in results:
            value = results[name][key]
            lines.append(f"{verdict(at_least(value, target))}  {label}: {fmt(value)} (target >= {target})")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options; --quick shortens the run to about a minute."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=None, help="a GGUF or HF folder (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens a run (default 192)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--no-float-check", action="store_true", help="skip the float32-activation identity check"
    )
    parser.add_argument(
        "--stagger-steps", type=int, default=8, help="swarm_staggered: engine steps between arrivals"
    )
    parser.add_argument(
        "--speculative-method",
        choices=("text", "mtp", "both"),
        default="text",
        help="the on engine's drafts: text (default), or with a Qwen3.5 file's MTP layer (mtp, both); run it "
        "with text and with both to compare MTP and text together against text alone, each against its off",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure and sample here")
    parser.add_argument("--quick", action="store_true", help="96 tokens, 1 repeat")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (96 if args.quick else 192)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the bench and print its table and verdicts."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    mtp = args.speculative_method != "text"
    loaded = load_model(resolve_model_path(args.model), dtype="float32", mtp=mtp)
    prompts = load_prompts()
    grammars = load_grammars(loaded.tokenizer)
    method = args.speculative_method
    llms = make_llms(loaded, args.max_tokens, no_siblings=STAGGERED in args.workloads, method=method)
    started = time.perf_counter()
    results = measure(
        llms, prompts, args.workloads, args.max_tokens, args.repeats, args.stagger_steps, grammars
    )
    float_identity = None
    if not args.no_float_check:
        float_llms = make_llms(loaded, args.max_tokens, method=method, cpu_int8_activations=False)
        float_identity = identity_check(
            float_llms, prompts, args.workloads, args.max_tokens, args.stagger_steps, grammars
        )
    print(
        f"speculation bench: {args.max_tokens} tokens, {args.repeats} repeats, {args.threads} threads, "
        f"{time.perf_counter() - started:.0f} s"
    )
    for line in report(results, float_identity):
        print(line)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json), "model": args.model},
                    "results": results,
                    "float_identity": float_identity,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
