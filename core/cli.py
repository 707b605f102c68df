"""Command-line flags generated from config dataclasses: one source of defaults and help text.

A config section is a dataclass whose fields are declared with :func:`option`; ``add_to_parser``
turns each field ``foo_bar`` into ``--foo-bar`` inside an argument group, and ``from_namespace``
builds the dataclass back from the parsed namespace. Validation stays in the dataclass
(``__post_init__`` raising ``ValueError`` that names the flag).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_MISSING = dataclasses.MISSING
_TYPES = {"int": int, "float": float, "str": str, "list": str}

# numeric rules for flags: (what the message says, test); nan and inf fail the "finite" ones
POSITIVE = ("a finite number > 0", lambda v: math.isfinite(v) and v > 0)
NON_NEGATIVE = ("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)
AT_LEAST_1 = (">= 1", lambda v: v >= 1)
AT_LEAST_0 = (">= 0", lambda v: v >= 0)
UNIT_OPEN = ("in [0, 1)", lambda v: 0 <= v < 1)
FRACTION = ("in (0, 1]", lambda v: 0 < v <= 1)


def checked(kind: Callable[[str], Any], rule: tuple) -> Callable[[str], Any]:
    """An argparse ``type`` for a flag outside the dataclasses: ``kind`` of the text, refused unless
    it passes ``rule`` (one of the rules above), so ``--budget nan`` is a usage error that names the
    flag (argparse adds the name) rather than a value every comparison quietly fails on."""
    want, ok = rule

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def option(default: Any = _MISSING, help: str = "", **argparse_kwargs: Any) -> Any:
    """A dataclass field with its help text and any extra ``add_argument`` keywords.

    A field without a default is a required flag. Lists take a ``default_factory`` through
    ``argparse_kwargs['nargs']`` and a tuple default.
    """
    meta = {"help": help, "argparse": argparse_kwargs}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_to_parser(parser: argparse.ArgumentParser, cls: type, title: str | None = None,
                  optional: tuple = ()) -> None:
    """Add one flag per field of dataclass ``cls`` (in its own group when ``title`` is given);
    fields named in ``optional`` are not required even without a default (they default to None)."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().split("\n")[0]) if title else parser
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kwargs = dict(f.metadata.get("argparse", {}))
        helptext = f.metadata.get("help", "")
        required = f.default is _MISSING and f.default_factory is _MISSING and f.name not in optional
        default = f.default if f.default is not _MISSING else \
            (f.default_factory() if f.default_factory is not _MISSING else None)
        if f.type in (bool, "bool") and "action" not in kwargs:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "type" not in kwargs and "action" not in kwargs:
            # the annotation decides (also for None defaults); lists take their items as str
            kwargs["type"] = _TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
        if not required and default not in (None, False, [], ()) and "action" not in kwargs:
            helptext += f" (default: {default if not isinstance(default, list) else ' '.join(map(str, default))})"
        group.add_argument(flag_name(f.name), dest=f.name, default=default, required=required,
                           help=helptext, **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build ``cls`` from the parsed flags that belong to it."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(ns).items() if k in names})
