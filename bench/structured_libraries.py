"""xgrammar against llguidance: grammar compile time, per-token mask time at batch 8, JSON Schema coverage.

Run: PYTHONPATH=src:tests python bench/structured_libraries.py  (or bench/structured.py --compare-libraries).
Each library is imported only if installed; a missing one is reported as such. The schemas are Claude
Code's own tool schemas (tests/claude_code_first_request.json) and bench/layout_cases.py's coding tools.
Mask time is one greedy-like walk per row (the token each step is the lowest allowed id past a few forced
JSON characters), so both libraries compute masks at the same grammar states; the figure is the mean
wall time of computing all 8 rows' masks for one step, on this CPU, beside whatever else runs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

# One feature per schema; the instance each must accept, and one it must refuse.
COVERAGE: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "enum": ({"type": "string", "enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": 3}, 3, 4),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "$ref/$defs": (
        {
            "$defs": {"p": {"type": "integer"}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/p"}},
            "required": ["x"],
        },
        {"x": 1},
        {"x": "1"},
    ),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}[0-9]$"}, "ab1", "abc"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "additionalProperties false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "format (date)": ({"type": "string", "format": "date"}, "2026-12-02", "02/12/2026"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, 5, 10),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, 1, None),
    "recursive $ref": (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/n",
        },
        {"c": [{"c": []}]},
        {"d": 1},
    ),
}


def tool_schemas() -> list[dict[str, Any]]:
    """Claude Code's tool schemas and the coding tools of bench/layout_cases.py."""
    import layout_cases

    body = json.loads((ROOT / "tests" / "claude_code_first_request.json").read_text())["body"]
    schemas = [t["input_schema"] for t in body["tools"]]
    schemas += [t["function"]["parameters"] for t in layout_cases.TOOLS.values()]
    return schemas


def tokenizer_jsons() -> dict[str, tuple[str, int, list[int]]]:
    """name -> (tokenizer.json text, vocab size, eos ids) for the embedded SmolLM2 and the Qwen3 vocabulary."""
    from conftest_tokenizer_helpers import qwen_tokenizer, smol_tokenizer

    out = {}
    for name, tok in (("smollm2", smol_tokenizer()), ("qwen3", qwen_tokenizer())):
        out[name] = (tok.backend.to_str(), tok.vocab_size, sorted(tok.eos_token_ids))
    return out


class Library:
    """One grammar library behind the four calls the comparison makes."""

    name = ""
    step = 0

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill_masks(self, matchers: list[Any]) -> None:
        raise NotImplementedError

    def pick(self, row: int) -> int | None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def validates(self, schema: dict[str, Any], instance: Any) -> bool:
        raise NotImplementedError


class Llguidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], batch: int) -> None:
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.mask = llguidance.torch.allocate_token_bitmask(batch, vocab_size)
        self.vocab_size = vocab_size
        self.eos = eos
        self.step = 0

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)  # compiles (lazily: the lexer is built as it runs)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def fill_masks(self, matchers: list[Any]) -> None:
        self.ll.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], self.mask
        )

    def pick(self, row: int) -> int | None:
        return _pick_allowed(self.mask[row], self.vocab_size, self.eos, self.step)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def validates(self, schema: dict[str, Any], instance: Any) -> bool:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        tokens = self.tok.tokenize_str(json.dumps(instance))
        return matcher.validate_tokens(tokens) == len(tokens) and _accepting_after(matcher, tokens)


def _accepting_after(matcher: Any, tokens: list[int]) -> bool:
    matcher.consume_tokens(tokens)
    return bool(matcher.is_accepting())


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], batch: int) -> None:
        import xgrammar
        from tokenizers import Tokenizer as Backend
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(batch, vocab_size)
        self.batch = xgrammar.BatchGrammarMatcher() if hasattr(xgrammar, "BatchGrammarMatcher") else None
        self.vocab_size = vocab_size
        self.eos = eos
        self.step = 0

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill_masks(self, matchers: list[Any]) -> None:
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(matchers, self.mask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(self.mask, i)

    def pick(self, row: int) -> int | None:
        return _pick_allowed(self.mask[row], self.vocab_size, self.eos, self.step)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def validates(self, schema: dict[str, Any], instance: Any) -> bool:
        matcher = self.xgr.GrammarMatcher(self.compile(schema))
        if not matcher.accept_string(json.dumps(instance)):
            return False
        matcher.fill_next_token_bitmask(self.mask, 0)
        return any(_allowed(self.mask[0], e) for e in self.eos)


def _allowed(mask_row: Any, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def _pick_allowed(mask_row: Any, vocab_size: int, eos: list[int], step: int) -> int | None:
    """A deterministic stand-in for sampling: an allowed non-stop token of one packed int32 bitmask row,
    spread over the allowed set by the step number; None when only a stop token is left."""
    import torch

    bits = (mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = [t for t in bits.flatten()[:vocab_size].nonzero().flatten().tolist() if t not in eos]
    return allowed[(step * 7919) % len(allowed)] if allowed else None


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def example_instance(schema: dict[str, Any]) -> Any:
    """A small instance of a tool schema: every property filled, strings a plausible path or command."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return {k: example_instance(v) for k, v in props.items()}
    if kind == "array":
        return [example_instance(schema.get("items", {"type": "string"}))]
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    return "src/swarmkv/engine/sampler.py --help"


def compare(
    lib: Library, schemas: list[dict[str, Any]], tokenize: Callable[[str], list[int]]
) -> dict[str, Any]:
    """Compile times of every schema; then 8 matchers walk 8 schemas' example instances token by token
    (the same states for both libraries), timing the batch-8 mask at every step."""
    compile_ms = []
    compiled = []
    for schema in schemas:
        elapsed, grammar = _timed(lambda s=schema: lib.compile(s))
        compile_ms.append(elapsed * 1e3)
        compiled.append(grammar)
    walks = [tokenize(json.dumps(example_instance(s))) for s in schemas]
    rows = [i % len(schemas) for i in range(8)]
    matchers = [lib.matcher(compiled[i]) for i in rows]
    mask_ms = []
    rejected = 0
    for step in range(max(len(walks[i]) for i in rows)):
        elapsed, _ = _timed(lambda: lib.fill_masks(matchers))
        mask_ms.append(elapsed * 1e3)
        for row, schema_index in enumerate(rows):
            walk = walks[schema_index]
            token = walk[step % len(walk)]
            if step % len(walk) == len(walk) - 1 or not lib.accept(matchers[row], token):
                rejected += step % len(walk) != len(walk) - 1
                matchers[row] = lib.matcher(compiled[schema_index])
    coverage = {}
    for feature, (schema, good, bad) in COVERAGE.items():
        try:
            ok = lib.validates(schema, good) and not lib.validates(schema, bad)
            coverage[feature] = "yes" if ok else "loose"
        except Exception as exc:  # a refusal to compile is what coverage measures
            coverage[feature] = f"refused: {str(exc).splitlines()[0][:60]}"
    return {
        "compile_ms_total": round(sum(compile_ms), 1),
        "compile_ms_max": round(max(compile_ms), 1),
        "mask_steps": len(mask_ms),
        "walk_tokens_rejected": rejected,
        "mask_ms_batch8_mean": round(statistics.mean(mask_ms), 3),
        "mask_ms_batch8_p90": round(sorted(mask_ms)[int(0.9 * len(mask_ms))], 3),
        "coverage": coverage,
    }


def main() -> None:
    """Print one JSON object per library and tokenizer."""
    schemas = tool_schemas()
    for tok_name, (text, vocab_size, eos) in tokenizer_jsons().items():
        for cls in (Xgrammar, Llguidance):
            try:
                setup_s, lib = _timed(lambda c=cls, t=text, v=vocab_size, e=eos: c(t, v, e, 8))
            except ImportError as exc:
                print(json.dumps({"library": cls.name, "tokenizer": tok_name, "missing": str(exc)}))
                continue
            from tokenizers import Tokenizer as Backend

            backend = Backend.from_str(text)
            result = compare(lib, schemas, lambda t, b=backend: b.encode(t, add_special_tokens=False).ids)
            out = {
                "library": cls.name,
                "tokenizer": tok_name,
                "num_schemas": len(schemas),
                "tokenizer_setup_ms": round(setup_s * 1e3),
                **result,
            }
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
