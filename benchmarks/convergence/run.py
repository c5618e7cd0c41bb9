"""Convergence at equal samples: methods trained side by side, then their loss or accuracy against DDP's.

    uv run benchmarks/convergence/run.py QUESTION [options] [--json PATH] [--table PATH]

The questions and their defaults are in ``questions.py`` (``run.py QUESTION --help`` lists the options);
each is answered by its module: ``classification`` (every method of ``harness/methods.py``'s grammar on
the main job's task, iid and label-skewed), ``lm`` and ``seeds`` (``lm.py``: the language model with
AdamW), ``adam_rules`` (Adam's second-moment rules in one process), ``attack`` (one Byzantine worker among
8) and ``accelerate`` (``accelerate_loop.py``: an Accelerate loop three ways). Local ranks start through
``harness/runner.py``; the table is printed and written with ``harness/report.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.convergence import accelerate_loop, adam_rules, attack, classification, lm
from benchmarks.convergence.questions import QUESTIONS
from benchmarks.harness.report import add_output_arguments, save

ANSWERS = {"classification": classification.answer, "lm": lm.answer, "adam_rules": adam_rules.answer}
ANSWERS |= {"seeds": lm.seeds, "attack": attack.answer, "accelerate": accelerate_loop.answer}


def parser() -> argparse.ArgumentParser:
    """One sub-command per question, its options made from the question's defaults."""
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    questions = top.add_subparsers(dest="question", required=True, metavar="QUESTION")
    for question in QUESTIONS.values():
        sub = questions.add_parser(question.name, help=question.asks, description=question.asks)
        for name, default in question.defaults.items():
            flag, choices = "--" + name.replace("_", "-"), question.choices.get(name)
            if name == "paths":
                sub.add_argument("paths", nargs="+", type=Path, help="JSON files of lm runs")
            elif name == "reuse":
                sub.add_argument(flag, nargs=2, action="append", default=[], metavar=("JSON", "METHOD"))
            elif isinstance(default, bool):
                sub.add_argument(flag, action="store_true")
            elif isinstance(default, type):  # unset unless given
                sub.add_argument(flag, type=default, default=None)
            else:
                many = isinstance(default, list)
                kind = type(default[0] if many else default)
                sub.add_argument(
                    flag, type=kind, nargs="+" if many else None, default=default, choices=choices,
                    help=f"default: {' '.join(map(str, default)) if many else default}",
                )  # fmt: skip
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
    results, text = ANSWERS[args.question](args)
    save(args, results, text)


if __name__ == "__main__":
    main()
