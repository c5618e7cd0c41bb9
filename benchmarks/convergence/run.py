"""Convergence at equal samples: methods trained side by side, their loss or accuracy against DDP's.

    uv run benchmarks/convergence/run.py QUESTION [options] [--json PATH] [--table PATH]

Questions and defaults: ``questions.py``; each answered by its module (``lm.py`` also ``seeds``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.convergence import accelerate_loop, adam_rules, attack, classification, lm
from benchmarks.convergence.questions import QUESTIONS
from benchmarks.harness.question_args import add_defaults
from benchmarks.harness.report import add_output_arguments, save

ANSWERS = {"classification": classification.answer, "lm": lm.answer, "adam_rules": adam_rules.answer}
ANSWERS |= {"seeds": lm.seeds, "attack": attack.answer, "accelerate": accelerate_loop.answer}


def special(defaults: dict[str, Any], choices: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The flags ``add_defaults`` cannot type from their default: choices, unset ones, ``--reuse``."""
    out: dict[str, dict[str, Any]] = {
        "reuse": dict(nargs=2, action="append", default=[], metavar=("JSON", "M"))
    }
    for name, allowed in choices.items():
        default = defaults[name]
        many = {"nargs": "+", "type": type(default[0])} if isinstance(default, list) else {}
        out[name] = {"choices": allowed, "default": default, **many}
    return out | {name: {"type": d, "default": None} for name, d in defaults.items() if isinstance(d, type)}


def parser() -> argparse.ArgumentParser:
    """One sub-command per question, its options made from the question's defaults."""
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    questions = top.add_subparsers(dest="question", required=True, metavar="QUESTION")
    for name, (asks, defaults, choices) in QUESTIONS.items():
        sub = questions.add_parser(name, help=asks, description=asks)
        if name == "seeds":
            sub.add_argument("paths", nargs="+", type=Path, help="JSON files of lm runs")
        add_defaults(sub, defaults, special(defaults, choices))
        add_output_arguments(sub)
    return top


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The question and its options, methods checked and their references added before any rank starts."""
    top = parser()
    args = top.parse_args(argv)
    try:
        if args.question == "classification":
            args.methods = classification.with_references(args.methods)
        elif args.question == "lm":
            args.methods = lm.with_twins(args.methods)
            lm.reused(args)
    except ValueError as error:
        top.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    save(args, *ANSWERS[args.question](args))


if __name__ == "__main__":
    main()
