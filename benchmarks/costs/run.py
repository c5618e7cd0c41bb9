"""What the wrapper costs per step, and in memory: variants of a step timed interleaved, side by side.

Every question (``benchmarks/costs/questions.py``) times its variants in one loop, the order
rotating every repetition, and reports ratios of medians (with the median of the paired ratios)
against a reference timed in the same loop; docs/benchmarks.md says what each found::

    uv run benchmarks/costs/run.py QUESTION [options] [--json PATH] [--table PATH]

An option a question does not take is refused; those it takes default to the question's own values
(listed below). Each process uses ``--threads`` torch threads (default 1: on a small shared VM a
multi-threaded memory pass waits for its slowest thread at every kernel).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.costs.questions import QUESTIONS, SEED_INSTALL
from benchmarks.costs.timing import environment, render
from benchmarks.harness.report import add_output_arguments, save

OPTIONS: dict[str, dict[str, Any]] = {
    "--width": {"type": int, "help": "the model's width"},
    "--depth": {"type": int, "help": "the model's layers"},
    "--batch": {"type": int, "help": "samples per training step"},
    "--iters": {"type": int, "help": "timed training steps of each variant"},
    "--warmup": {"type": int, "help": "untimed steps first"},
    "--reps": {"type": int, "help": "repetitions: rounds (overhead, compression), records, interpreters"},
    "--threads": {"type": int, "help": "torch threads per process"},
    "--worlds": {"type": int, "nargs": "+", "help": "world sizes of part (a) (1 always runs: part (b))"},
    "--formats": {"nargs": "+", "help": "wire formats ('none': the uncompressed round)"},
    "--mode": {"choices": ("engine", "codec"), "help": "engine: 2 CPU ranks; codec: one process"},
    "--device": {"help": "codec mode: cpu or cuda"},
    "--seed-path": {
        "help": f"a folder holding the seed release 0.1.1, timed beside the rest ({SEED_INSTALL})"
    },
    "--memory-steps": {"type": int, "help": "steps of each memory run"},
    "--rounds": {"type": int, "help": "rounds of the records-on and records-off jobs"},
    "--budget": {"type": float, "help": "seconds the library may add to torch's import"},
    "--max-seconds": {"type": float, "help": "deadline of each run of ranks"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    questions = "\n".join(
        f"  {name}: {q.help}\n    defaults: "
        + ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in q.defaults.items())
        for name, q in QUESTIONS.items()
    )
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=f"questions:\n{questions}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("question", choices=QUESTIONS, metavar="QUESTION", help=", ".join(QUESTIONS))
    for flag, spec in OPTIONS.items():
        parser.add_argument(flag, default=None, **spec)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    defaults = QUESTIONS[args.question].defaults
    for flag in OPTIONS:
        key = flag[2:].replace("-", "_")
        if key in defaults:
            setattr(args, key, defaults[key] if getattr(args, key) is None else getattr(args, key))
        elif getattr(args, key) is not None:
            parser.error(f"{args.question} takes no {flag}; its options: {', '.join(defaults)}")
        else:
            delattr(args, key)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one question; the exit status is 1 when its results say ``over_budget``."""
    args = parse_args(argv)
    question = QUESTIONS[args.question]
    results = {"environment": environment(), **question.measure(args)}
    save(args, results, results["environment"] + "\n\n" + render(results["tables"]))
    return 1 if results.get("over_budget") else 0


if __name__ == "__main__":
    sys.exit(main())
