"""A question driver's command line: one sub-command per question (a named set of defaults, its
``questions.py``), one ``--flag`` per default beside ``--json`` and ``--table``."""

import argparse
from collections.abc import Mapping
from typing import Any

from benchmarks.harness.report import add_output_arguments


def add_defaults(
    parser: argparse.ArgumentParser, defaults: Mapping[str, Any],
    special: Mapping[str, dict[str, Any]] | None = None, empty_lists: bool = False,
) -> None:  # fmt: skip
    """A ``--flag`` per default: a bool on and off, a list of its items' type (at least one, unless
    ``empty_lists`` or the default is empty), else its own type; ``special``: other flags' keywords."""
    for key, default in defaults.items():
        flag = "--" + key.replace("_", "-")
        if special and key in special:
            parser.add_argument(flag, **special[key])
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, list):
            kind = type(default[0]) if default else str
            nargs = "*" if empty_lists or not default else "+"
            parser.add_argument(flag, nargs=nargs, type=kind, default=list(default))
        else:
            parser.add_argument(flag, type=type(default), default=default, help=f"default {default}")


def question_parser(
    description: str, questions: Mapping[str, tuple[Any, ...]], **options: Any
) -> argparse.ArgumentParser:
    """``questions``: name -> (help line, defaults[, own ``special``]); ``options``: :func:`add_defaults`."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=description, formatter_class=raw)
    subparsers = parser.add_subparsers(dest="question", required=True, metavar="QUESTION")
    for name, (help_line, defaults, *own) in questions.items():
        sub = subparsers.add_parser(name, help=help_line, description=help_line)
        add_defaults(sub, defaults, **(options | ({"special": own[0]} if own else {})))
        add_output_arguments(sub)
    return parser
