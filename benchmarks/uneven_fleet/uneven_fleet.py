"""Uneven fleets: the whole fleet's samples per second with paced rounds, synchronous gossip and DDP.

    sudo flock /tmp/dow-heavy.lock uv run benchmarks/uneven_fleet/uneven_fleet.py --nodes 8 [--json PATH]

``--nodes`` emulated nodes (network namespaces on a bridge, every link shaped to ``--bandwidth`` with
``tc tbf``; ``harness/emulated_cluster.py``), one worker each. A step's forward and backward are
sleeps of ``--compute-ms`` times the rank's speed factor (``uneven_fleet_worker.py``: the parameters,
AdamW, the bytes and the collectives are real), so 8 or 16 workers fit on 2 cores. Scenarios: half the
workers 2x slower (``half2x``), one worker 3x slower (``one3x``), and the slow worker changing
mid-run (``shift``: rank 0 3x slower for ``--shift-s`` seconds, then the last rank). Methods, run
one after the other in each scenario: each rank alone (``nocomm``, its own rate), DDP, synchronous
low-communication gossip (``sync``: ring, ``sync_every=8``, every rank 8 steps per round) and the same
with ``pacing="measured"`` (``paced``).

Measured: the fleet's steps per second (all ranks' steps over a window, at equal batches this is
samples per second over the batch), from the end of the warm-up (3 rounds; paced: 5 rounds, so the
first pace messages have arrived) to the first rank's last step. Beside it: the sum of the workers'
own rates in the same window, ``sum_i 1 / (c f_i + o)`` (``c f_i`` the rank's compute at that time,
``o`` the per-step time beyond compute measured by ``nocomm``), and today's bound, ``n`` times the
slowest rate. Target: paced rounds reach at least 90% of the sum of own rates.

Needs root (network namespaces); without it, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_cluster import (
    Cluster,
    measure_link,
    node_env,
    ready_to_emulate,
    start_in_node,
    stop,
)
from benchmarks.uneven_fleet.uneven_fleet_worker import METHODS, SCENARIOS, speed_factor
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict

WORKER = Path(__file__).with_name("uneven_fleet_worker.py")
TARGET = 0.90  # paced rounds' share of the sum of the workers' own rates
PLANNER_TARGET = 0.15  # the planner's prediction of each measured rate, relative error
WARMUP_ROUNDS = {"ddp": 3, "sync": 3, "paced": 5}


def run_cluster(nodes: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Every scenario and method on ``nodes`` emulated nodes: each rank's results, and the link's
    measured Mbit/s."""
    outdir = Path(tempfile.mkdtemp(prefix="dow-uneven-"))
    try:
        with Cluster(nodes) as cluster:
            cluster.shape(args.bandwidth)
            megabits = measure_link(cluster, 4, 29669)
            procs = []
            for rank in range(nodes):
                flags = {
                    "--rank": rank,
                    "--world-size": nodes,
                    "--rounds": args.rounds,
                    "--sync-every": args.sync_every,
                    "--compute-ms": args.compute_ms,
                    "--shift-s": args.shift_s,
                    "--nocomm-s": args.nocomm_s,
                    "--inputs": args.inputs,
                    "--width": args.width,
                    "--depth": args.depth,
                    "--out": outdir / f"rank{rank}.json",
                }
                argv = [str(WORKER), *[str(item) for pair in flags.items() for item in pair]]
                argv += ["--scenarios", *args.scenarios, "--methods", *args.methods]
                env = node_env(cluster, rank, 29701 + nodes)
                procs.append(start_in_node(cluster, rank, argv, env, outdir / f"rank{rank}.log"))
            deadline = time.monotonic() + args.budget_s
            try:
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    if any(p.returncode not in (None, 0) for p in procs):
                        break
                    time.sleep(0.5)
                failed = [r for r, p in enumerate(procs) if p.poll() not in (0, None)]
                timed_out = any(p.poll() is None for p in procs)
            finally:
                stop(procs)
            if failed or timed_out:
                rank = failed[0] if failed else 0
                tail = (outdir / f"rank{rank}.log").read_text()[-2000:]
                raise RuntimeError(f"{nodes} nodes: rank {rank} failed or timed out; its log ends:\n{tail}")
            return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nodes)], megabits
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def overhead_seconds(ranks: list[dict[str, Any]], scenario: str, args: argparse.Namespace) -> float:
    """``o``: a step's time beyond its compute when training alone (median over the ranks of their mean,
    the first two steps left out)."""
    n = len(ranks)
    beyond = []
    for rank, result in enumerate(ranks):
        run = result[f"{scenario}/nocomm"]
        began = [run["start"], *run["ends"][:-1]]
        extra = [
            end
            - begin
            - args.compute_ms / 1e3 * speed_factor(scenario, rank, n, begin - run["start"], args.shift_s)
            for begin, end in zip(began, run["ends"], strict=True)
        ]
        beyond.append(statistics.fmean(extra[2:]))
    return statistics.median(beyond)


def own_rates(
    scenario: str, n: int, window: tuple[float, float], o: float, args: argparse.Namespace
) -> tuple[float, float]:
    """The sum of the workers' own rates and ``n`` times the slowest, averaged over ``window`` (seconds
    since the start), steps per second."""
    a, b = window
    points = 2000
    total = slowest = 0.0
    for k in range(points):
        at = a + (k + 0.5) * (b - a) / points
        rates = [
            1.0 / (args.compute_ms / 1e3 * speed_factor(scenario, r, n, at, args.shift_s) + o)
            for r in range(n)
        ]
        total += sum(rates)
        slowest += n * min(rates)
    return total / points, slowest / points


def fleet_rate(
    ranks: list[dict[str, Any]], key: str, method: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Steps of all ranks per second over the window after warm-up, and the window."""
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
        "steps": [len(run["ends"]) for run in runs],
    }
    paces = [run.get("pace") for run in runs]
    if all(paces):
        duration = [run["ends"][-1] - run["start"] for run in runs]
        entry["waited_fraction"] = [p["waited_s"] / d for p, d in zip(paces, duration, strict=True)]
    return entry


def planned_rates(
    scenario: str,
    nodes: int,
    megabits: float,
    o: float,
    args: argparse.Namespace,
    model_bytes: float | None = None,
    delay: int | None = None,
) -> dict[str, float]:
    """The planner's fleet steps per second of each method (constant speeds only; ``shift`` changes):
    of this benchmark's MLP unless ``model_bytes`` is given, its rounds folded in ``delay`` steps late
    (default a whole round, ``args.sync_every``)."""
    if scenario == "shift":
        return {}
    factors = tuple(speed_factor(scenario, r, nodes, 0.0, args.shift_s) for r in range(nodes))
    if model_bytes is None:
        model_bytes = 4.0 * sum(
            p.numel() for p in build_mlp(args.inputs, args.width, args.depth, 10).parameters()
        )
    every = args.sync_every
    delay = every if delay is None else delay
    found = predict(
        model_bytes,
        ComputeTimes(args.compute_ms / 1e3, "uneven", factors=factors),
        Network(Link(megabits * 1e6)),
        nodes,
        ["ring"],
        compressions=(),
        steps=args.rounds * every,
        warmup=3 * every,
        local_steps=[(every, delay)],
        overhead_s=o,
        paced=True,
    )
    labels = {"ddp": "ddp", "sync": f"ring~h{every}d{delay}", "paced": f"ring~h{every}d{delay}p"}
    step_s = {p.method: p.step_s for p in found}
    return {method: nodes / step_s[label] for method, label in labels.items() if label in step_s}


def report(
    nodes: int, ranks: list[dict[str, Any]], megabits: float, args: argparse.Namespace
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print(
        f"\n{nodes} nodes, links shaped to {args.bandwidth} ({megabits:.0f} Mbit/s measured), compute "
        f"{args.compute_ms:.0f} ms x factor, H={args.sync_every}"
    )
    for scenario in args.scenarios:
        o = overhead_seconds(ranks, scenario, args)
        print(f"  {scenario}: per-step time beyond compute o = {1e3 * o:.1f} ms")
        print(
            f"    {'method':<7} {'steps/s':>8} {'/ own':>7} {'/ n*slowest':>11} {'planned':>8}  window s   "
            "steps per rank"
        )
        rows: dict[str, Any] = {}
        planned = planned_rates(scenario, nodes, megabits, o, args)
        for method in (m for m in args.methods if m != "nocomm"):
            entry = fleet_rate(ranks, f"{scenario}/{method}", method, args)
            ideal, today = own_rates(scenario, nodes, entry["window_s"], o, args)
            entry.update(own_sum=ideal, slowest_times_n=today, of_own=entry["steps_per_s"] / ideal)
            entry["of_today"] = entry["steps_per_s"] / today
            entry["planned"] = planned.get(method)
            rows[method] = entry
            window = "{:.1f}-{:.1f}".format(*entry["window_s"])
            rate, of_own, of_today = entry["steps_per_s"], entry["of_own"], entry["of_today"]
            plan = "-" if entry["planned"] is None else f"{entry['planned']:.2f}"
            print(
                f"    {method:<7} {rate:>8.2f} {of_own:>7.3f} {of_today:>11.3f} {plan:>8}"
                f"  {window:<10} {min(entry['steps'])}-{max(entry['steps'])}"
            )
        if "paced" in rows:
            paced = rows["paced"]
            if "sync" in rows:
                paced["over_sync"] = paced["steps_per_s"] / rows["sync"]["steps_per_s"]
            if "ddp" in rows:
                paced["over_ddp"] = paced["steps_per_s"] / rows["ddp"]["steps_per_s"]
            met = paced["of_own"] >= TARGET
            waited = max(paced.get("waited_fraction", [0.0]))
            over_sync, over_ddp = paced.get("over_sync", float("nan")), paced.get("over_ddp", float("nan"))
            print(
                f"    paced: {100 * paced['of_own']:.1f}% of the own rates (target {100 * TARGET:.0f}%: "
                f"{'met' if met else 'MISSED'}), {over_sync:.2f}x synchronous gossip, {over_ddp:.2f}x DDP; "
                f"most time a rank waited: {100 * waited:.1f}%"
            )
        errors = {m: r["planned"] / r["steps_per_s"] - 1 for m, r in rows.items() if r["planned"]}
        if errors:
            worst = max(errors.values(), key=abs)
            text = ", ".join(f"{m} {100 * e:+.1f}%" for m, e in errors.items())
            verdict = "met" if abs(worst) <= PLANNER_TARGET else "MISSED"
            print(f"    planner vs measured: {text} (target within {100 * PLANNER_TARGET:.0f}%: {verdict})")
        summary[scenario] = {"overhead_s": o, "methods": rows, "planner_error": errors}
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8])
    parser.add_argument("--bandwidth", default="200mbit", help="tc rate of every link, both ways")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--shift-s", type=float, default=6.0)
    parser.add_argument("--nocomm-s", type=float, default=5.0)
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=900.0, help="kill the workers after this long")
    parser.add_argument("--json", help="write the measured figures here")
    args = parser.parse_args()
    if "nocomm" not in args.methods:
        parser.error("--methods must include nocomm (it measures the per-step time beyond compute)")
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    everything = []
    for nodes in args.nodes:
        ranks, megabits = run_cluster(nodes, args)
        everything.append(
            {"nodes": nodes, "megabits": megabits, "summary": report(nodes, ranks, megabits, args)}
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": everything}, indent=1))


if __name__ == "__main__":
    main()
