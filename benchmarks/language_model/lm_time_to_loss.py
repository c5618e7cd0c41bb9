"""Time to reach DDP's loss on the language model: measured steps times predicted step time.

    uv run benchmarks/language_model/lm_time_to_loss.py benchmarks/results/adam/lm-iid-{2,4,8,16}.json

Reads the convergence driver's ``lm`` results run with ``--eval-every`` (files with the same DDP result, as
``--reuse`` copies it, are one run and merged), takes for
each method the first evaluated step at which the average model reaches DDP's final validation loss
at that world size times ``--tolerance`` (1.02 by default: within the 2% target, since a method that
ends 1% above DDP never reaches DDP's own final loss under a cosine schedule; 1.0 asks for it
exactly), and multiplies it by the step time the planner (``decent_optim_wrapper.plan``,
validated against the emulated cluster on the scaling page) predicts for that method on as many
nodes, one rank each, for this model's bytes. The network: by default links that move one fp32
model in one step's compute (the scaling page's setting), with compute ``--compute-ms`` per step
(18 ms: the benchmark model's forward and backward at batch 16 on one core of the 2-core VM), without
jitter and with log-normal jitter (sigma 0.3). Both the steps and the times are printed beside DDP's.
Blocking per-step gossip (``~h1d0``: ``sync_every=1, sync_delay=0``) hides nothing behind compute:
the planner simulates it with each round added to the step (its next compute waits for the round).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness.methods import parse_method
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose validation loss is at most ``target`` (None: never)."""
    return next((step for step, loss in curve if loss <= target), None)


def step_times(
    model_bytes: float, nodes: int, compute_s: float, bandwidth: float, jitter: str
) -> dict[str, float]:
    """Predicted seconds per step of DDP and of every gossip topology (uncompressed) on ``nodes`` nodes,
    overlapped and blocking (``ring`` and ``ring~h1d0``)."""
    compute = ComputeTimes(compute_s, jitter=jitter, sigma=0.3)
    network = Network(Link(bandwidth))
    predictions = predict(model_bytes, compute, network, nodes, compressions=(), blocking=True)
    return {p.method: p.step_s for p in predictions}


def merged_runs(paths: list[Path]) -> list[list[dict[str, Any]]]:
    """The ``iid`` results of ``paths``, one list per run of the same flags: files whose DDP result
    is the same (the same workers and loss, as ``--reuse`` copies it) are merged, first file first."""
    runs: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for path in paths:
        results = [r for r in json.loads(path.read_text()) if r["split"] == "iid"]
        reference = next((r for r in results if r["method"] == "ddp+adamw"), None)
        if reference is None:
            raise SystemExit(f"{path} has no ddp+adamw result to compare with")
        run = runs.setdefault((reference["workers"], reference["validation_loss"]), {})
        for r in results:
            run.setdefault(r["method"], r)
    return [list(run.values()) for run in runs.values()]


def topology_of(method: str) -> str:
    spec = parse_method(method)
    return "ddp" if spec.topology is None else spec.topology


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "results", nargs="+", type=Path, help="lm_convergence.py --json files (same DDP result: merged)"
    )
    parser.add_argument("--compute-ms", type=float, default=18.0)
    parser.add_argument("--bandwidth", type=float, default=None, help="bits/s per node and direction")
    parser.add_argument("--tolerance", type=float, default=1.02, help="reach DDP's final loss times this")
    args = parser.parse_args()
    for results in merged_runs(args.results):
        workers = results[0]["workers"]
        reference = next(r for r in results if r["method"] == "ddp+adamw")
        model_bytes = 4.0 * reference["parameters"]
        target = reference["validation_loss"] * args.tolerance
        compute_s = args.compute_ms / 1000
        bandwidth = args.bandwidth or 8 * model_bytes / compute_s  # one model per step's compute
        times = {j: step_times(model_bytes, workers, compute_s, bandwidth, j) for j in ("none", "lognormal")}
        print(
            f"\n{workers} nodes, {reference['parameters']:,} parameters, lr {reference['adam_lr']}: DDP's "
            f"final validation loss {reference['validation_loss']:.4f} (target x{args.tolerance:g}: "
            f"{target:.4f}); compute {args.compute_ms:g} ms/step, "
            f"links {bandwidth / 1e6:.0f} Mbit/s"
        )
        print(
            f"{'method':>26} | {'steps':>6} | {'ms/step':>7} | {'time s':>7} | {'vs DDP':>6} | "
            f"{'ms/step jit':>11} | {'time jit':>8} | {'vs DDP':>6}"
        )
        ddp_steps = steps_to_reach([tuple(point) for point in reference["curve"]], target)
        for r in results:
            if parse_method(r["method"]).sync_every != 1:
                continue
            steps = steps_to_reach([tuple(point) for point in r["curve"]], target)
            name = topology_of(r["method"])
            if parse_method(r["method"]).sync_delay == 0:  # blocking rounds: the planner's blocking scheme
                name += "~h1d0"
            if steps is None or name not in times["none"]:
                print(f"{r['method']:>26} | {'never':>6} |")
                continue
            cells = []
            for jitter in ("none", "lognormal"):
                step_s = times[jitter][name]
                ddp_s = times[jitter]["ddp"] * (ddp_steps or 0)
                total = steps * step_s
                cells += [f"{step_s * 1000:>7.1f}" if jitter == "none" else f"{step_s * 1000:>11.1f}"]
                cells += [f"{total:>7.1f}" if jitter == "none" else f"{total:>8.1f}"]
                cells += [f"{total / ddp_s:>6.2f}" if ddp_s else f"{'-':>6}"]
            print(f"{r['method']:>26} | {steps:>6} | " + " | ".join(cells))
    print(
        "(steps: first evaluation at or below the target; 'jit': log-normal compute jitter, sigma 0.3; "
        "'~h1d0': blocking per-step gossip, each round added to the step)"
    )


if __name__ == "__main__":
    main()
