"""Faults: workers that die, hang, restart or join while a job trains, and what surviving costs.

    uv run benchmarks/faults/run.py QUESTION [options] [--json PATH] [--table PATH]

Defaults: ``questions.py``; answers: ``soak.py`` (kills, rejoins), ``lost_worker.py``, ``joins.py``
(joining, grow-back), ``node_check.py``.
"""

from __future__ import annotations

import argparse

from benchmarks.faults import joins, lost_worker, node_check, soak
from benchmarks.faults.questions import QUESTIONS
from benchmarks.harness.question_args import question_parser
from benchmarks.harness.report import save

ANSWERS = {
    "kills": soak.kills,
    "rejoins": soak.rejoins,
    "lost-worker": lost_worker.answer,
    "joining": joins.joining,
    "grow-back": joins.grow_back,
    "node-check": node_check.answer,
}


def refusal(args: argparse.Namespace) -> str | None:
    """Why these options make no run (checked before any worker starts), or None."""
    if args.question in ("kills", "rejoins") and not 1 < args.floor < args.workers:
        return f"--floor must be between 2 and --workers - 1, got {args.floor} with {args.workers} workers"
    if args.question == "lost-worker" and not 0 < args.kill_at < args.steps:
        return f"--kill-at must be inside the run (0 < k < {args.steps}), got {args.kill_at}"
    if args.question == "grow-back" and not 0 <= args.lose_at < args.steps - 1:
        return f"--lose-at must be a step before the last, got {args.lose_at} with --steps {args.steps}"
    if args.question == "node-check" and args.warmup >= args.steps:
        return f"--warmup must be below --steps, got {args.warmup} with --steps {args.steps}"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    top = question_parser(__doc__, QUESTIONS, empty_lists=True)
    args = top.parse_args(argv)
    if (why := refusal(args)) is not None:
        top.error(why)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, text = ANSWERS[args.question](args)
    save(args, results, text)


if __name__ == "__main__":
    main()
