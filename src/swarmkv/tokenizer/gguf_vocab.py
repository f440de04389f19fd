"""Rebuild a GGUF file's byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) with `tokenizers`.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, a type per token and the
name of a pre-tokenizer (`tokenizer.ggml.pre`) whose splitting rules live in llama.cpp's source. The
table below restates those rules as the `tokenizers` pre-tokenizers of the models' own
`tokenizer.json` files, so that token ids match what the model was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from swarmkv.errors import ModelLoadError, UnsupportedModelError

# llama.cpp's token types (gguf.TokenType): only these two are matched whole inside text.
_CONTROL = 3
_USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerRule:
    """How one `tokenizer.ggml.pre` value splits text before BPE runs."""

    # None means GPT-2's regex, which `tokenizers` builds into its ByteLevel pre-tokenizer.
    split_regex: str | None
    # StarCoder-family vocabularies put every digit in a piece of its own before the GPT-2 regex.
    split_digits: bool = False
    # Llama-3-style vocabularies look a whole piece up in the vocabulary before merging.
    ignore_merges: bool = False
    # What llama.cpp assumes when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos_default: bool = False


def _rules(*groups: tuple[tuple[str, ...], PreTokenizerRule]) -> Mapping[str, PreTokenizerRule]:
    return MappingProxyType({name: rule for names, rule in groups for name in names})


# Names and rule groups follow llama.cpp's `llama_vocab::impl::load`; unknown names are refused.
PRE_TOKENIZER_RULES: Mapping[str, PreTokenizerRule] = _rules(
    (
        ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "mellum"),
        PreTokenizerRule(split_regex=None),
    ),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        PreTokenizerRule(split_regex=None, split_digits=True),
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
        PreTokenizerRule(split_regex=_QWEN2_SPLIT),
    ),
    (("qwen35",), PreTokenizerRule(split_regex=_QWEN35_SPLIT)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizerRule(split_regex=_LLAMA3_SPLIT, ignore_merges=True, add_bos_default=True),
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), PreTokenizerRule(split_regex=_LLAMA3_SPLIT)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizerRule(split_regex=_GPT4O_SPLIT)),
    (("tekken",), PreTokenizerRule(split_regex=_TEKKEN_SPLIT, ignore_merges=True, add_bos_default=True)),
)


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF tokenizer rebuilt as a `tokenizers` backend, with its special token ids."""

    backend: Backend
    tokens: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool

    def token_text(self, token_id: int | None) -> str | None:
        """The vocabulary's spelling of `token_id`, or None when the id is None or out of range."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it in byte-level vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    if rule.split_regex is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if not rule.split_digits:
            return byte_level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rule.split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _optional_id(meta: Mapping[str, Any], key: str, num_tokens: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    token_id = int(value)
    # Some converters write an out-of-range id to mean "none"; llama.cpp treats it the same way.
    return token_id if 0 <= token_id < num_tokens else None


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    bos = vocab.token_text(vocab.bos_token_id) if vocab.add_bos_token else None
    eos = vocab.token_text(vocab.eos_token_id) if vocab.add_eos_token else None
    if bos is None and eos is None:
        return None
    single = " ".join(part for part in (bos, "$A", eos) if part is not None)
    pair = " ".join(part for part in (bos, "$A", eos, bos, "$B:1", eos) if part is not None)
    special = [
        (text, token_id)
        for text, token_id in ((bos, vocab.bos_token_id), (eos, vocab.eos_token_id))
        if text is not None and token_id is not None
    ]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _added_tokens(
    tokens: list[str], token_types: list[int], vocab: dict[str, int]
) -> tuple[list[AddedToken], list[AddedToken]]:
    # A control token spelled outside the byte alphabet is a converter mislabel (transformers skips it
    # too); registering it would give it a fresh id past the model's embedding table.
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and token in vocab
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and token in vocab
    ]
    return control, user_defined


def build_gguf_vocab(meta: Mapping[str, Any]) -> GGUFVocab:
    """Rebuild the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported; swarmkv reads byte-level BPE ('gpt2') vocabularies"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelLoadError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"GGUF metadata has {len(tokens)} tokens but {len(token_types)} entries in tokenizer.ggml.token_type"
        )
    # llama.cpp falls back to a generic regex for a missing name; GPT-2's is the same family.
    pre_name = meta.get("tokenizer.ggml.pre") or "gpt2"
    rule = PRE_TOKENIZER_RULES.get(pre_name)
    if rule is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_RULES))}"
        )

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Plain-text tokens (added tokens holding a space, say) are respelled byte by byte, as transformers does.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF merge {merge!r} is not two tokens separated by a space")
        pairs.append((left, right))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=rule.ignore_merges))
    backend.pre_tokenizer = _pre_tokenizer(rule)
    backend.decoder = decoders.ByteLevel()
    control, user_defined = _added_tokens(tokens, token_types, vocab)
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)

    num_tokens = len(tokens)
    result = GGUFVocab(
        backend=backend,
        tokens=tuple(tokens),
        bos_token_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", num_tokens),
        eos_token_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", num_tokens),
        unk_token_id=_optional_id(meta, "tokenizer.ggml.unknown_token_id", num_tokens),
        pad_token_id=_optional_id(meta, "tokenizer.ggml.padding_token_id", num_tokens),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", rule.add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    post_processor = _post_processor(result)
    if post_processor is not None:
        backend.post_processor = post_processor
    return result
