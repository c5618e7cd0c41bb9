"""Ratios to DDP over several runs (seeds) of ``lm_convergence.py``: each run, their mean and worst.

    uv run benchmarks/language_model/lm_seeds.py benchmarks/results/adam/lm-iid-4-h8-seed*-h200cpu.json \\
        --target 1.05

One run's validation losses are only comparable with that run's DDP: a seed changes the model's
initialization and every rank's batch order, and on this task it moves DDP's own loss by 1-2%. So
each method's loss is divided by the DDP loss of its own run, and only then are the runs summarised.
Files with the same DDP result (``--reuse`` copies it) are one run and merged, as in
``time_to_loss/run.py lm``. A method with a ``-local`` twin (``second_moment="local"``) gets the twin's
mean beside its own: the uncorrected rule's figure. ``--target``: how many runs end within it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.methods import LOCAL_MOMENT_SUFFIX


def merged_runs(paths: list[Path]) -> list[list[dict[str, Any]]]:
    """The ``iid`` results of ``paths``, one list per run: files whose DDP result is the same (the same
    workers and loss, as ``--reuse`` copies it) are merged, first file first."""
    runs: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for path in paths:
        results = [r for r in json.loads(Path(path).read_text()) if r["split"] == "iid"]
        reference = next((r for r in results if r["method"] == "ddp+adamw"), None)
        if reference is None:
            raise SystemExit(f"{path} has no ddp+adamw result to compare with")
        run = runs.setdefault((reference["workers"], reference["validation_loss"]), {})
        for r in results:
            run.setdefault(r["method"], r)
    return [list(run.values()) for run in runs.values()]


def ratios_by_method(paths: list[Path]) -> tuple[int, dict[str, list[float]]]:
    """The number of runs, and per method its loss over its run's DDP loss, one entry per run that
    has it (in the order of the runs: the first file of each)."""
    runs = merged_runs(paths)
    ratios: dict[str, list[float]] = {}
    for run in runs:
        ddp = next(r["validation_loss"] for r in run if r["method"] == "ddp+adamw")
        for result in run:
            if result["method"] != "ddp+adamw":
                ratios.setdefault(result["method"], []).append(result["validation_loss"] / ddp)
    return len(runs), ratios


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="lm_convergence.py --json files")
    parser.add_argument("--target", type=float, default=1.05, help="ratio to DDP a run should end within")
    args = parser.parse_args()
    count, ratios = ratios_by_method(args.paths)
    print(f"{count} runs; each method's validation loss over its own run's DDP loss")
    header = (
        f"{'method':>34} | {'runs':>24} | {'mean':>6} | {'worst':>6} | within {args.target:g} | uncorrected"
    )
    print(header)
    print("-" * len(header))
    for method, values in ratios.items():
        if method.endswith(LOCAL_MOMENT_SUFFIX):
            continue
        twin = ratios.get(method + LOCAL_MOMENT_SUFFIX)
        runs = " ".join(f"{v:.3f}" for v in values)
        within = sum(v <= args.target for v in values)
        uncorrected = "-" if twin is None else f"{statistics.mean(twin):.3f}"
        print(
            f"{method:>34} | {runs:>24} | {statistics.mean(values):6.3f} | {max(values):6.3f} | "
            f"{within:>4} of {len(values):<3} | {uncorrected}"
        )


if __name__ == "__main__":
    main()
