"""The model the `plan` flags name: --model's files, or a shape (and, with every size given, a config to count
weights from) built from the size flags."""

from __future__ import annotations

import argparse

from swarmkv.config import Architecture, ModelConfig
from swarmkv.plan.checkpoint import Checkpoint, load_checkpoint
from swarmkv.plan.shape import KVShape
from swarmkv.plan.weights import Precision

KV_SHAPE_FLAGS = {"--layers": "layers", "--kv-heads": "kv_heads", "--head-dim": "head_dim"}
SIZE_FLAGS = {
    "--hidden-size": "hidden_size",
    "--intermediate-size": "intermediate_size",
    "--vocab-size": "vocab_size",
    "--heads": "heads",
}
SWITCH_FLAGS = {
    "--tie-embeddings": "tie_embeddings",
    "--qk-norm": "qk_norm",
    "--attention-bias": "attention_bias",
}


def _flags_config(args: argparse.Namespace) -> ModelConfig:
    """A ModelConfig from the size flags, every one of them given and positive."""
    missing = [flag for flag, dest in SIZE_FLAGS.items() if getattr(args, dest) is None]
    if missing:
        raise ValueError(
            f"counting the weights from flags needs {', '.join(SIZE_FLAGS)} (missing {', '.join(missing)})"
        )
    for flag, dest in SIZE_FLAGS.items():
        if getattr(args, dest) <= 0:
            raise ValueError(f"{flag} must be a positive integer, got {getattr(args, dest)}")
    # The family only names the model: q/k norms and biases are their own fields.
    family: Architecture = "qwen3" if args.qk_norm else "qwen2" if args.attention_bias else "llama"
    return ModelConfig(
        architecture=family,
        num_layers=int(args.layers),
        hidden_size=int(args.hidden_size),
        num_heads=int(args.heads),
        num_kv_heads=int(args.kv_heads),
        head_dim=int(args.head_dim),
        intermediate_size=int(args.intermediate_size),
        vocab_size=int(args.vocab_size),
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=int(args.context),  # the rotary table covers the planned context
        tie_word_embeddings=bool(args.tie_embeddings),
        qk_norm=bool(args.qk_norm),
        attention_bias=bool(args.attention_bias),
    )


def resolve_checkpoint(args: argparse.Namespace) -> Checkpoint:
    """The model from --model's files, or from the shape flags; "auto" formats and dtypes resolved."""
    values = {flag: getattr(args, dest) for flag, dest in {**KV_SHAPE_FLAGS, **SIZE_FLAGS}.items()}
    given = [flag for flag, value in values.items() if value is not None]
    given += [flag for flag, dest in SWITCH_FLAGS.items() if getattr(args, dest)]
    if args.model is not None:
        if given:
            raise ValueError(
                f"give --model or {', '.join(KV_SHAPE_FLAGS)}, not both ({', '.join(given)} with --model)"
            )
        return load_checkpoint(
            args.model, args.kv_dtype, args.state_dtype, args.weight_format, getattr(args, "mtp", False)
        )
    missing = [flag for flag in KV_SHAPE_FLAGS if values[flag] is None]
    if missing:
        raise ValueError(
            f"no KV shape: give --model, or {', '.join(KV_SHAPE_FLAGS)} (missing {', '.join(missing)})"
        )
    precision = Precision.resolve(args.weight_format, "float16")
    layers = int(args.layers)
    kv_dtype = precision.kv_dtype(args.kv_dtype)
    shape = KVShape(layers, layers, int(args.kv_heads), int(args.head_dim), kv_dtype)
    if all(flag in KV_SHAPE_FLAGS for flag in given):
        problem = "the flags give the KV shape only; add --hidden-size, --intermediate-size, --vocab-size and --heads"
        return Checkpoint(shape, precision, None, problem, None)
    return Checkpoint(shape, precision, _flags_config(args), None, None)


def parse_counts(text: str, flag: str, least: int, noun: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]; ValueError naming `flag` unless it is a list of `noun` >= `least`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{flag} wants comma-separated integers, got {text!r}") from exc
    if not values or min(values) < least:
        raise ValueError(f"{flag} wants {noun} >= {least}, got {text!r}")
    return values
