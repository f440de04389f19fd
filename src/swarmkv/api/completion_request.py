"""The /v1/completions body: the shared generation fields and one prompt, as text or token ids."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from swarmkv.api.errors import bad_request, get_field
from swarmkv.api.limits import check_array_counts
from swarmkv.api.options import Options, parse_options

# OpenAI's legacy completions default: a body without max_tokens gets 16 tokens, not the context's room.
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/completions body: one prompt, as text or token ids."""

    options: Options
    prompt: str | list[int]


# The top-level arrays a completions body's parser counts before it reads anything.
COMPLETION_ARRAYS = ("stop",)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a completions body."""
    check_array_counts(body, COMPLETION_ARRAYS)
    options = parse_options(body)
    if options.max_tokens is None:
        options = replace(options, max_tokens=DEFAULT_MAX_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not (is_ids and prompt):
        raise bad_request(
            "'prompt' must be a string or a non-empty array of token ids (one prompt per request)",
            param="prompt",
        )
    if (
        body.get("echo")
        or body.get("suffix") is not None
        or get_field(body, "best_of", int, "an integer", 1) != 1
    ):
        raise bad_request("echo, suffix and best_of are not supported", param="prompt")
    return CompletionRequest(options, prompt)
