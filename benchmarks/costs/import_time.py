"""What ``import decent_optim_wrapper`` costs beyond ``import torch``: a joiner's and a test's start-up.

Each statement runs in fresh interpreters (nothing cached in the process), ``--repeats`` times,
interleaved so that a busy machine slows all of them alike; the best time of each is the one least
disturbed by other work. Printed: the best wall time of

- ``import torch``,
- ``import torch; import torch.distributed`` (what every gossip worker needs anyway),
- ``import torch; import decent_optim_wrapper``,

and the library's cost: the time of ``import decent_optim_wrapper`` itself, measured inside the
last interpreter after ``import torch`` (best of the runs; the difference of two whole start-ups
is printed too, but on a busy machine it carries the noise of both). The script exits with status 1
when that cost exceeds ``--budget`` seconds (0.5 s by default): sharded training's imports
(``torch.distributed.tensor``, which pulls in sympy) belong to the runs that shard, not to every
start-up.

Run: ``uv run benchmarks/costs/import_time.py [--repeats 3] [--budget 0.5] [--json PATH]``
(about 30 seconds on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

STATEMENTS = {
    "torch": "import torch",
    "torch.distributed": "import torch; import torch.distributed",
    "decent_optim_wrapper": "import torch; import decent_optim_wrapper",
}

#: Prints the seconds ``import decent_optim_wrapper`` takes after ``import torch`` in the same process: wall
#: time, then CPU time (which a busy machine barely changes).
LIBRARY_ALONE = (
    "import time, torch; wall, cpu = time.perf_counter(), time.process_time(); import decent_optim_wrapper; "
    "print(time.perf_counter() - wall, time.process_time() - cpu)"
)


def wall_time(statement: str) -> tuple[float, str]:
    """Seconds a fresh interpreter takes to run ``statement`` and exit, and what it printed."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True, text=True)
    return time.perf_counter() - start, done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per statement (best of)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds the library may add to torch")
    parser.add_argument("--json", help="save the times here")
    args = parser.parse_args(argv)

    wall_time("import torch")  # warm the file cache: the first interpreter reads torch from disk
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    alone: list[float] = []
    cpu: list[float] = []
    for _ in range(args.repeats):
        for name, statement in STATEMENTS.items():
            times[name].append(wall_time(statement)[0])
        wall_s, cpu_s = wall_time(LIBRARY_ALONE)[1].split()
        alone.append(float(wall_s))
        cpu.append(float(cpu_s))
    best = {name: min(t) for name, t in times.items()}
    cost = min(alone)
    print(f"best of {args.repeats} fresh interpreters (torch {torch.__version__}, {platform.machine()}):")
    for name, statement in STATEMENTS.items():
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"  {statement:<45} {best[name]:6.2f} s   (runs: {runs})")
    print(f"difference of the best start-ups: {best['decent_optim_wrapper'] - best['torch']:+.2f} s")
    within = cost <= args.budget
    print(
        f"import decent_optim_wrapper after import torch: {cost:.2f} s (runs: "
        f"{', '.join(f'{t:.2f}' for t in alone)}), {'within' if within else 'OVER'} the budget of "
        f"{args.budget:.2f} s"
    )
    print(f"  of which CPU time: {min(cpu):.2f} s (runs: {', '.join(f'{t:.2f}' for t in cpu)})")
    if args.json:
        with open(args.json, "w") as out:
            record = {
                "times_s": times,
                "library_s": alone,
                "library_cpu_s": cpu,
                "cost_s": cost,
                "budget_s": args.budget,
            }
            json.dump(record, out, indent=2)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
