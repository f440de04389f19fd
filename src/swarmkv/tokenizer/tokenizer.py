"""The tokenizer the engine uses: text <-> token ids, special ids, and the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from swarmkv.errors import InvalidRequestError, ModelLoadError
from swarmkv.tokenizer.chat import ChatTemplate
from swarmkv.tokenizer.gguf_vocab import build_gguf_vocab

# Tokens that end a turn or a document in the chat formats swarmkv meets; each one present in a
# vocabulary as a special token stops generation, so a model that closes its turn with
# <|endoftext|> instead of its configured eos still stops.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)

# Normalizers after which a text has at least a third of its UTF-8 bytes (`Tokenizer.normalized_shrink`).
_SHRINKING_AT_MOST_3 = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})

# Texts past this many characters are encoded in a batch of one, which releases the GIL while it runs.
_LONG_TEXT_CHARS = 100_000

# The named special tokens transformers hands every chat template (its `special_tokens_map`).
_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A byte-level BPE tokenizer with its special token ids and chat template, from HF files or a GGUF."""

    backend: Backend = field(repr=False)
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    template: ChatTemplate | None = field(repr=False)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load a HF model folder's tokenizer.json, tokenizer_config.json and, if present, chat_template.jinja."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; swarmkv needs the fast-tokenizer file a model repo ships"
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelLoadError(f"{tokenizer_file} cannot be read: {exc}") from exc
        config = {
            **_read_json(folder / "special_tokens_map.json"),
            **_read_json(folder / "tokenizer_config.json"),
        }
        token_texts = {
            name: text for name in _TEMPLATE_TOKEN_NAMES if (text := _token_text(config.get(name)))
        }

        def token_id(name: str) -> int | None:
            text = token_texts.get(name)
            return backend.token_to_id(text) if text is not None else None

        eos_ids = {token_id("eos_token")} | set(_generation_eos_ids(folder / "generation_config.json"))
        default_source, tool_use_source = _chat_template_sources(folder, config)
        return cls(
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=token_id("bos_token"),
            eos_token_ids=_eos_ids(backend, eos_ids),
            pad_token_id=token_id("pad_token"),
            template=_template(default_source, tool_use_source, token_texts),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer and chat template a GGUF file's metadata describes."""
        vocab = build_gguf_vocab(meta)
        ids = {
            "bos_token": vocab.bos_token_id,
            "eos_token": vocab.eos_token_id,
            "unk_token": vocab.unk_token_id,
            "pad_token": vocab.pad_token_id,
        }
        token_texts = {name: text for name, token_id in ids.items() if (text := vocab.token_text(token_id))}
        source = meta.get("tokenizer.chat_template")
        return cls(
            backend=vocab.backend,
            # The file's token list is the embedding table's row count; every id below it is valid.
            vocab_size=len(vocab.tokens),
            bos_token_id=vocab.bos_token_id,
            eos_token_ids=_eos_ids(vocab.backend, {vocab.eos_token_id}),
            pad_token_id=vocab.pad_token_id,
            template=_template(source if isinstance(source, str) else None, None, token_texts),
        )

    @property
    def chat_template(self) -> str | None:
        """The jinja source of the model's chat template, or None when the model ships none."""
        return self.template.source if self.template is not None else None

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for: a byte-level entry's length (one character a
        byte), an added token's or any other entry's UTF-8 length (SentencePiece's "▁" counts 3 for its 1)."""
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        added = {token.content for token in self.backend.get_added_tokens_decoder().values()}
        entries = self.backend.get_vocab(with_added_tokens=True)
        return max(
            (
                len(e) if byte_level and e not in added else len(e.encode("utf-8", "surrogatepass"))
                for e in entries
            ),
            default=1,
        )

    @cached_property
    def normalized_shrink(self) -> int | None:
        """How many times fewer UTF-8 bytes a text can have once the tokenizer's normalizer ran: 1 without one,
        3 under Unicode normal forms and lower-casing (three Hangul jamo compose into one syllable, a
        fullwidth "Ａ" becomes "A", the Kelvin sign "k"); None for a normalizer that can remove text
        (StripAccents, Replace, ...), under which a text's bytes bound its tokens not at all."""
        if self.backend.normalizer is None:
            return 1
        spec = json.loads(self.backend.normalizer.__getstate__())
        kinds = [n.get("type") for n in spec.get("normalizers", [spec])] if isinstance(spec, dict) else [None]
        return 3 if all(kind in _SHRINKING_AT_MOST_3 for kind in kinds) else None

    def min_num_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to: its UTF-8 bytes over what one token can stand for (0 when
        the normalizer leaves no bound); no tokenizing, so it costs one pass over the text."""
        if self.normalized_shrink is None:
            return 0
        num_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        per_token = self.max_token_bytes * self.normalized_shrink
        return -(-num_bytes // per_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_start|>") become their single ids."""
        if len(text) > _LONG_TEXT_CHARS:
            # The backend's `encode` holds the GIL throughout (a minute for 21 MB), its `encode_batch` does not,
            # so a long text tokenized on a worker thread leaves the event loop running.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_text_prompt(self, text: str) -> list[int]:
        """Token ids of a raw text prompt (completions, `LLM.generate` on a string): with the tokenizer's own
        special tokens, such as a BOS, as the model expects a prompt to start. A chat template writes its
        special tokens itself, so templated text goes through `encode` instead."""
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text `ids` spell; invalid UTF-8 (a character cut in two) decodes to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (in its byte-level spelling), or None when absent."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` in its byte-level spelling, or None when out of range."""
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (and `tools`) with the model's chat template into prompt text."""
        if self.template is None:
            raise InvalidRequestError(
                "this model has no chat template, so chat messages cannot be turned into a prompt; "
                "send a plain-text prompt to the completions endpoint instead"
            )
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialised AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _generation_eos_ids(path: Path) -> list[int]:
    value = _read_json(path).get("eos_token_id")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int)]
    return []


def _chat_template_sources(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), None
    value = config.get("chat_template")
    if value is None:
        value = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        default = named.get("default")
        if default is None:
            raise ModelLoadError(
                f"{folder} lists named chat templates but none called 'default': {sorted(map(str, named))}"
            )
        return default, named.get("tool_use")
    return None, None


def _template(
    source: str | None, tool_use_source: str | None, token_texts: Mapping[str, str]
) -> ChatTemplate | None:
    if source is None:
        return None
    return ChatTemplate(
        source=source, tool_use_source=tool_use_source, special_tokens=tuple(token_texts.items())
    )


def _eos_ids(backend: Backend, configured: set[int | None]) -> frozenset[int]:
    special_ids = {
        token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
    }
    turn_ends = {backend.token_to_id(text) for text in END_OF_TURN_TOKENS}
    return frozenset(token_id for token_id in configured | (turn_ends & special_ids) if token_id is not None)
