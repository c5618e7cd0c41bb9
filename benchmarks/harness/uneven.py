"""Uneven fleets (``cluster/run.py uneven``, ``time_to_loss``): speed scenarios, the fleet's measured
rate, its bounds and the planner's rate. ``args`` carries ``compute_ms``, ``shift_s``, ``sync_every``,
``rounds`` and the MLP's ``inputs``, ``width``, ``depth``.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.common import build_mlp
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict

SCENARIOS = ("half2x", "one3x", "shift")
TARGET = 0.90  # paced rounds' share of the sum of the workers' own rates
PLANNER_TARGET = 0.15  # the planner's prediction of each measured rate, relative error
WARMUP_ROUNDS = {"ddp": 3, "sync": 3, "paced": 5}  # paced: 5, so that the first pace messages arrived


def speed_factor(scenario: str, rank: int, world_size: int, elapsed_s: float, shift_s: float) -> float:
    """How many times the base compute a step of ``rank`` takes ``elapsed_s`` into the run: ``half2x``
    (the first half 2x), ``one3x`` (rank 0 3x), ``shift`` (rank 0 3x until ``shift_s``, then the last)."""
    if scenario == "half2x":
        return 2.0 if rank < world_size // 2 else 1.0
    if scenario == "one3x":
        return 3.0 if rank == 0 else 1.0
    if scenario == "shift":
        slow = 0 if elapsed_s < shift_s else world_size - 1
        return 3.0 if rank == slow else 1.0
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")


def overhead_seconds(ranks: list[dict[str, Any]], scenario: str, args: Any) -> float:
    """``o``: a step's time beyond its compute when alone (median over ranks of their mean, from step 2)."""
    beyond = []
    for rank, result in enumerate(ranks):
        run = result[f"{scenario}/nocomm"]
        steps = list(zip([run["start"], *run["ends"][:-1]], run["ends"], strict=True))
        factor = [speed_factor(scenario, rank, len(ranks), a - run["start"], args.shift_s) for a, _ in steps]
        extra = [b - a - args.compute_ms / 1e3 * f for (a, b), f in zip(steps, factor, strict=True)]
        beyond.append(statistics.fmean(extra[2:]))
    return statistics.median(beyond)


def own_rates(scenario: str, n: int, window: tuple[float, float], o: float, args: Any) -> tuple[float, float]:
    """Steps/s: the sum of the workers' own rates and ``n`` x the slowest, averaged over ``window``."""
    a, b = window
    points = 2000
    total = slowest = 0.0
    for k in range(points):
        at = a + (k + 0.5) * (b - a) / points
        rates = [
            1 / (args.compute_ms / 1e3 * speed_factor(scenario, r, n, at, args.shift_s) + o) for r in range(n)
        ]
        total += sum(rates)
        slowest += n * min(rates)
    return total / points, slowest / points


def fleet_rate(ranks: list[dict[str, Any]], key: str, method: str, args: Any) -> dict[str, Any]:
    """Steps of all ranks per second from the end of the warm-up to the first rank's last step."""
    runs = [r[key] for r in ranks]
    start = min(run["start"] for run in runs)
    warm = WARMUP_ROUNDS[method]
    if method == "ddp":
        began = max(run["ends"][warm * args.sync_every - 1] for run in runs)
    else:
        began = max(run["round_ends"][warm - 1] for run in runs)
    ended = min(run["ends"][-1] for run in runs)
    steps = sum(sum(1 for t in run["ends"] if began < t <= ended) for run in runs)
    entry: dict[str, Any] = {
        "steps_per_s": steps / (ended - began),
        "window_s": (began - start, ended - start),
    }
    entry["steps"] = [len(run["ends"]) for run in runs]
    paces = [run.get("pace") for run in runs]
    if all(paces):
        duration = [run["ends"][-1] - run["start"] for run in runs]
        entry["waited_fraction"] = [p["waited_s"] / d for p, d in zip(paces, duration, strict=True)]
    return entry


def planned_rates(
    scenario: str, nodes: int, megabits: float, o: float, args: Any, model_bytes: float | None = None,
    delay: int | None = None,
) -> dict[str, float]:  # fmt: skip
    """The planner's fleet steps per second of each method (constant speeds only: not ``shift``), of
    the MLP unless ``model_bytes`` is given, its rounds folded ``delay`` steps late (default a round)."""
    if scenario == "shift":
        return {}
    factors = tuple(speed_factor(scenario, r, nodes, 0.0, args.shift_s) for r in range(nodes))
    if model_bytes is None:
        mlp = build_mlp(args.inputs, args.width, args.depth, 10)
        model_bytes = 4.0 * sum(p.numel() for p in mlp.parameters())
    every = args.sync_every
    delay = every if delay is None else delay
    compute = ComputeTimes(args.compute_ms / 1e3, "uneven", factors=factors)
    options = {"steps": args.rounds * every, "warmup": 3 * every, "local_steps": [(every, delay)]}
    options |= {"overhead_s": o, "compressions": (), "paced": True}
    found = predict(model_bytes, compute, Network(Link(megabits * 1e6)), nodes, ["ring"], **options)
    labels = {"ddp": "ddp", "sync": f"ring~h{every}d{delay}", "paced": f"ring~h{every}d{delay}p"}
    step_s = {p.method: p.step_s for p in found}
    return {method: nodes / step_s[label] for method, label in labels.items() if label in step_s}
