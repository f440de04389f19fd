"""Command-line flags derived from `ModelOptions` and `EngineConfig`: one default, one help text, per option.

Every command that runs a model calls `add_model_arguments` and `add_engine_arguments`; a command that sets
an option itself (the swarm sets `max_num_seqs` to its agent count) skips that flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from swarmkv.core.config import EngineConfig, ModelOptions
from swarmkv.units import parse_size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(parser: argparse.ArgumentParser, cls: type, skip: Iterable[str]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("flag", False):
            continue
        help_text, default, kind = f.metadata["help"], f.default, hints[f.name]
        if kind is bool:
            # A switch that is on by default is turned off with --no-NAME.
            parser.add_argument(
                _flag(f.name) if not default else "--no-" + f.name.replace("_", "-"),
                dest=f.name,
                action="store_false" if default else "store_true",
                help=help_text,
            )
            continue
        options: dict[str, Any] = {
            "dest": f.name,
            "default": default,
            "help": f"{help_text} (default {default})",
        }
        if typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif f.name.endswith("_memory"):  # sizes: kv_cache_memory, offload_memory, max_pinned_memory
            options["type"] = _size_or_auto if default == "auto" else parse_size
        elif _is_int(kind):
            options["type"] = _int_or(_literal_words(kind))
        parser.add_argument(_flag(f.name), **options)


def _size_or_auto(text: str) -> int | str:
    """A size flag's value where the setting also takes auto (offload_memory)."""
    return "auto" if text == "auto" else parse_size(text)


def _is_int(kind: Any) -> bool:
    if kind is int:
        return True
    args = typing.get_args(kind)
    is_union = isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union
    return is_union and int in args and str not in args


def _literal_words(kind: Any) -> tuple[str, ...]:
    """The words a union such as `int | Literal["auto"] | None` allows beside integers."""
    return tuple(
        w
        for arg in typing.get_args(kind)
        if typing.get_origin(arg) is typing.Literal
        for w in typing.get_args(arg)
    )


def _int_or(words: tuple[str, ...]) -> Callable[[str], int | str]:
    """An argparse type: one of `words` as it is, else an integer."""

    def parse(value: str) -> int | str:
        return value if value in words else int(value)

    parse.__name__ = "int"  # argparse names the type in its error message
    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device."""
    _add_fields(parser, ModelOptions, ())


def add_engine_arguments(parser: argparse.ArgumentParser, skip: Iterable[str] = ()) -> None:
    """One flag per EngineConfig field, except those in `skip` and those meant for code only."""
    _add_fields(parser, EngineConfig, tuple(skip))


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelOptions fields found in parsed arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelOptions)}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig flags found in parsed arguments (those a command skipped are left out)."""
    fields = dataclasses.fields(EngineConfig)
    return {f.name: getattr(args, f.name) for f in fields if f.metadata["flag"] and hasattr(args, f.name)}
