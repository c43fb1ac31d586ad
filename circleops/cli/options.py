"""``circleops convert``'s option flags, built from circleops.options.ConvertOptions' fields
(each field with a ``flag`` is one), and the ConvertOptions of the parsed flags, built once.

A flag's choices come from the registry that defines them (``"circleops.targets:TARGETS"``),
its help may name them (``{choices}``). Standard library only at import time: ``circleops
convert --help`` must not load torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any, Iterable

from circleops.options import OPTION_GROUPS, ConvertOptions, Flag


def _resolve(ref: str) -> Any:
    """``"module:NAME"`` -> that object."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def declared(groups: Iterable[str] | None = None) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every ConvertOptions field that is a flag of ``groups`` (None: all)."""
    wanted = None if groups is None else set(groups)
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(ConvertOptions)
            if "flag" in f.metadata and (wanted is None or f.metadata["flag"].group in wanted)]


def _help(flag: Flag, choices: Any) -> str:
    """The flag's help, its ``{names}`` filled in from where they are defined."""
    from circleops.options import DEFAULT_MAX_CACHE_LEN, DEFAULT_PREFILL_LENS

    if "{" not in flag.help:
        return flag.help
    values = {"choices": "; ".join(f"{k}: {v}" for k, v in choices.items()) if hasattr(choices, "items") else choices,
              "prefill_lens": ",".join(map(str, DEFAULT_PREFILL_LENS)), "max_cache_len": DEFAULT_MAX_CACHE_LEN}
    if "{INT16_PARTS}" in flag.help:
        from circleops.quantize import INT16_PARTS, INT16_PRESETS

        values.update(INT16_PARTS="; ".join(f"{k}: {v}" for k, v in INT16_PARTS.items()), INT16_PRESETS=INT16_PRESETS)
    return flag.help.format(**values)


def add_options(parser: argparse.ArgumentParser, groups: Iterable[str] | None = None) -> None:
    """The flags of ``groups`` (None: every group), each group under its --help heading."""
    sections: dict[str, Any] = {}
    for f, flag in declared(groups):
        if flag.group not in sections:
            sections[flag.group] = parser.add_argument_group(OPTION_GROUPS[flag.group])
        choices = _resolve(flag.choices) if isinstance(flag.choices, str) else flag.choices
        default = flag.cli_default if flag.cli_default is not None else f.default
        kw: dict[str, Any] = dict(dest=f.name, help=_help(flag, choices))
        if flag.kind == "bool":
            kw.update(action="store_true")
        elif flag.kind == "list":
            kw.update(action="append", default=[], metavar=flag.metavar)
        else:
            kw.update(default=default, metavar=flag.metavar, type={"int": int, "float": float}.get(flag.kind, str))
            if choices is not None:
                kw["choices"] = list(choices)
        sections[flag.group].add_argument(flag.name, **kw)


def options_of(args: argparse.Namespace, groups: Iterable[str] | None = None) -> ConvertOptions:
    """The ConvertOptions of the parsed flags of ``groups`` (a flag's ``parse`` applied)."""
    values = {}
    for f, flag in declared(groups):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if flag.parse is not None and value is not None:
            value = _resolve(flag.parse)(value)
        values[f.name] = value
    return ConvertOptions(**values)
