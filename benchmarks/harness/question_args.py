"""A question driver's command line: one sub-command per question, one ``--flag`` per default.

A driver's questions are named sets of defaults (its ``questions.py``); :func:`question_parser` makes
each a sub-command whose options are those defaults, typed after them, beside ``--json`` and
``--table`` (``report.py``), so that ``run.py QUESTION --name value`` overrides any one of them and
``run.py QUESTION --help`` lists them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from benchmarks.harness.report import add_output_arguments


def add_defaults(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, Any],
    special: Mapping[str, dict[str, Any]] | None = None,
    empty_lists: bool = False,
) -> None:
    """A ``--flag`` per default: a bool on and off, a list of its items' type (at least one, unless
    ``empty_lists`` or the default is empty), anything else of its own type; ``special``: the
    ``add_argument`` keywords of the flags that fit none of these."""
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
    """The driver's parser: ``questions`` maps a name to its help line, its defaults and, optionally,
    its own ``special`` flags; ``options`` go to :func:`add_defaults` (``special``, ``empty_lists``)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=description, formatter_class=raw)
    subparsers = parser.add_subparsers(dest="question", required=True, metavar="QUESTION")
    for name, (help_line, defaults, *own) in questions.items():
        sub = subparsers.add_parser(name, help=help_line, description=help_line)
        add_defaults(sub, defaults, **(options | ({"special": own[0]} if own else {})))
        add_output_arguments(sub)
    return parser
