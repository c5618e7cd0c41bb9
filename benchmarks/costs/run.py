"""What the wrapper costs per step and in memory: each question (``questions.py``) times variants in one
loop, the order rotating, against a reference in the same loop. ``--threads``: per process (default 1).

    uv run benchmarks/costs/run.py QUESTION [options] [--json PATH] [--table PATH]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.costs.questions import QUESTIONS, SEED_INSTALL, environment, render
from benchmarks.harness.question_args import question_parser
from benchmarks.harness.report import save

MODES = {"choices": ("engine", "codec"), "default": "engine"}  # engine: 2 CPU ranks; codec: one process
SEED = f"a folder holding the seed release 0.1.1, timed beside the rest: {SEED_INSTALL}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """A question and its options (its help: its measurement's docstring's first paragraph)."""
    helps = {
        name: (" ".join(ask.__doc__.split("\n\n")[0].split()), defaults)
        for name, (ask, defaults) in QUESTIONS.items()
    }
    description = f"{__doc__}\nsecond_moment --seed-path DIR: {SEED}\n"
    parser = question_parser(description, helps, special={"mode": MODES, "seed_path": {"help": SEED}})
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        options = ", ".join(QUESTIONS[args.question][1])
        parser.error(f"{args.question} takes no {unknown[0]}; its options: {options}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one question; the exit status is 1 when its results say ``over_budget``."""
    args = parse_args(argv)
    results = {"environment": environment(), **QUESTIONS[args.question][0](args)}
    save(args, results, results["environment"] + "\n\n" + render(results["tables"]))
    return 1 if results.get("over_budget") else 0


if __name__ == "__main__":
    sys.exit(main())
