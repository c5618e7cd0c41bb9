"""Uneven fleets: time to DDP's final loss of the language model, paced rounds against synchronous gossip.

    sudo flock /tmp/dow-heavy.lock uv run --group bench benchmarks/uneven_fleet/time_to_loss.py \\
        --nodes 4 8 16 [--scenarios one3x half2x] [--json PATH]   # 9-13 min per node count, scenario

For every node count of ``--nodes`` (one worker per emulated node: network namespaces on a bridge,
every link shaped to ``--bandwidth`` with ``tc tbf``, ``harness/emulated_cluster.py``) and every
scenario (``one3x``: rank 0 three times slower; ``half2x``: the first half of the ranks twice as slow;
``harness/uneven.speed_factor``), the language model of ``harness/lm_task.py`` (AdamW, lr 3e-3,
batch ``--batch`` per worker, iid windows) is trained with each method in turn, every rank from the
same model. A step's compute is ``--compute-ms`` times the rank's factor: the model's own forward,
backward and update (measured here first) topped up by a sleep (``harness/lm_worker.py``'s
``--pad-ms``), so that 16 nodes fit on 2 cores (the model's real step x 16 ranks / 2 cores stays
under ``--compute-ms``). Methods:

* ``nocomm``: every rank alone for ``--nocomm-steps`` steps: the per-step time beyond compute (the
  planner's overhead);
* ``ddp``: DistributedDataParallel for ``--steps`` steps, cosine schedule over them. Its final
  validation loss (of the model every rank holds) is the target;
* ``sync``: synchronous low-communication gossip, ``--gossip`` (``ring~h8d1``: a ring, ``sync_every=8``,
  each round folded in one step late, no outer optimizer: the setting that ends nearest DDP with
  AdamW on this model, ``docs/adam.md``), every rank ``H`` steps a round;
* ``paced``: the same with ``pacing="measured"``: each rank takes as many steps a round as its
  measured speed allows.

The gossip methods train by rounds, ``--budget`` times DDP's samples (``budget * steps / H`` rounds,
each of ``N H`` steps of the fleet whatever the pacing), the learning rate a cosine over the rounds;
they end a few percent above DDP's loss at equal samples, so they need more samples than DDP to reach
it. Every rank writes its parameters every ``--eval-every`` steps (gossip: at the end of every
``eval_every / H``-th round, the same round on every rank); afterwards the replicas' average is
evaluated (256 fixed validation windows), so the curve costs the run nothing, and a method's time to
the target is the training seconds (writes left out) at the first evaluation at or below it.

Measured, per node count and scenario: DDP's final loss; each method's seconds to it (``not reached``
within the budget is said so); the ratio sync / paced (target: at least 1.5); each method's fleet
steps per second after warm-up (``harness/uneven.fleet_rate``) beside the planner's simulation of the
mode (``decent_optim_wrapper.plan.predict(..., paced=True)`` with the measured link, the factors and the
``nocomm`` overhead; target: within 15%).

Needs root (network namespaces); without it, it says so and exits 0. Hold the shared lock
(``flock /tmp/dow-heavy.lock ...``): the cluster's namespaces are removed at start and exit.
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

from benchmarks.harness.emulated_cluster import (
    Cluster,
    measure_link,
    node_env,
    ready_to_emulate,
    start_in_node,
    stop,
)
from benchmarks.harness.lm_snapshots import evaluate, reached, real_step_seconds
from benchmarks.harness.lm_task import make_lm_model
from benchmarks.harness.methods import parse_method
from benchmarks.harness.uneven import (
    PLANNER_TARGET,
    fleet_rate,
    overhead_seconds,
    planned_rates,
    speed_factor,
)

WORKER = Path(__file__).parents[1] / "harness" / "lm_worker.py"
METHODS = ("nocomm", "ddp", "sync", "paced")
SCENARIOS = ("one3x", "half2x")
TARGET_SOONER = 1.5  # synchronous gossip's time to DDP's loss over paced rounds'


def gossip_rounds(args: argparse.Namespace) -> int:
    """Rounds of the gossip methods: ``--budget`` times DDP's samples."""
    return int(args.budget * args.steps) // args.sync_every


def worker_argv(
    method: str, rank: int, nodes: int, scenario: str, real_ms: float, outdir: Path, args: argparse.Namespace
) -> list[str]:
    """The worker's command line for ``rank`` of ``method`` (its pad: ``compute_ms`` x factor - real)."""
    factor = speed_factor(scenario, rank, nodes, 0.0, 0.0)
    flags: dict[str, Any] = {
        "--rank": rank,
        "--world-size": nodes,
        "--steps": args.steps,
        "--stop-at": args.nocomm_steps if method == "nocomm" else args.steps,
        "--eval-every": args.nocomm_steps if method == "nocomm" else args.eval_every,
        "--batch": args.batch,
        "--adam-lr": args.adam_lr,
        "--pad-ms": max(0.0, args.compute_ms * factor - real_ms),
        "--width": args.width,
        "--depth": args.depth,
        "--outdir": outdir,
        "--method": method if method in ("nocomm", "ddp") else args.gossip,
    }
    if method in ("sync", "paced"):
        flags["--rounds"] = gossip_rounds(args)
        flags["--eval-rounds"] = max(1, args.eval_every // args.sync_every)
        flags["--pacing"] = "measured" if method == "paced" else "none"
    return [str(WORKER), *[str(item) for pair in flags.items() for item in pair]]


def run_method(
    cluster: Cluster, method: str, scenario: str, real_ms: float, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ``method`` on every node: each rank's record (step ends, round ends, pace) and the
    evaluated curve of the replicas' average. Raises if a rank failed or ran out of time."""
    nodes = cluster.nodes
    outdir = Path(tempfile.mkdtemp(prefix="dow-uneven-ttl-"))
    args.port_offset = (args.port_offset + 1) % 16  # a fresh port per run: the last run's may linger
    procs = []
    try:
        for rank in range(nodes):
            argv = worker_argv(method, rank, nodes, scenario, real_ms, outdir, args)
            env = node_env(cluster, rank, 29741 + args.port_offset)
            procs.append(start_in_node(cluster, rank, argv, env, outdir / f"rank{rank}.log"))
        deadline = time.monotonic() + args.deadline_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                time.sleep(0.5)
        finally:
            stop(procs)
        missing = [r for r in range(nodes) if not (outdir / f"rank{r}.json").exists()]
        if missing:
            tail = (outdir / f"rank{missing[0]}.log").read_text()[-2000:]
            raise RuntimeError(f"{method}: rank {missing[0]} failed or timed out; its log ends:\n{tail}")
        ranks = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nodes)]
        return ranks, evaluate(outdir, nodes, args)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def time_to_target(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """DDP's final loss (the target) and each method's (evaluated step, seconds) to it, or None; the
    ratio synchronous / paced (a lower bound, ``sync_reached`` False, when synchronous gossip never
    reached it: its last evaluation's seconds instead)."""
    target = runs["ddp"]["curve"][-1][2]
    hits = {m: reached(r["curve"], target) for m, r in runs.items() if m != "nocomm"}
    hits["ddp"] = (runs["ddp"]["curve"][-1][0], runs["ddp"]["curve"][-1][1])
    out: dict[str, Any] = {"target": target, "hits": hits, "sync_over_paced": None, "sync_reached": None}
    if "sync" in hits and hits.get("paced") is not None:
        sync = hits["sync"]
        out["sync_reached"] = sync is not None
        sync_s = sync[1] if sync is not None else runs["sync"]["curve"][-1][1]
        out["sync_over_paced"] = sync_s / hits["paced"][1]
    return out


def rates(
    timing: list[dict[str, Any]],
    scenario: str,
    nodes: int,
    megabits: float,
    model_bytes: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Measured fleet steps per second of ddp, sync and paced after warm-up, the planner's, and the
    relative error of each prediction."""
    o = overhead_seconds(timing, scenario, args)
    planner_args = argparse.Namespace(
        **{**vars(args), "rounds": min(gossip_rounds(args), 30), "shift_s": 0.0}
    )
    delay = parse_method(args.gossip).sync_delay
    planned = planned_rates(scenario, nodes, megabits, o, planner_args, model_bytes, delay)
    measured = {
        m: fleet_rate(timing, f"{scenario}/{m}", m, args)["steps_per_s"]
        for m in ("ddp", "sync", "paced")
        if f"{scenario}/{m}" in timing[0]
    }
    errors = {m: planned[m] / rate - 1 for m, rate in measured.items() if planned.get(m)}
    return {"overhead_s": o, "measured": measured, "planned": planned, "planner_error": errors}


def step_seconds(record: dict[str, Any]) -> list[float]:
    """A rank's step times from its recorded start and step ends."""
    ends = record["ends"]
    return [b - a for a, b in zip([record["start"], *ends[:-1]], ends, strict=True)]


def verdicts(row: dict[str, Any]) -> dict[str, bool]:
    """The two targets of one node count and scenario."""
    ratio, errors = row["sync_over_paced"], row["planner_error"]
    return {
        "sooner": ratio is not None and ratio >= TARGET_SOONER,
        "planner": bool(errors) and all(abs(e) <= PLANNER_TARGET for e in errors.values()),
    }


def print_row(nodes: int, scenario: str, row: dict[str, Any]) -> None:
    hits, runs = row["hits"], row["runs"]

    def when(method: str) -> str:
        if method not in hits:
            return "-"
        if hits[method] is None:
            return f">{runs[method]['curve'][-1][1]:.0f} (not reached)"
        return f"{hits[method][1]:.1f}"

    print(f"  {scenario}: DDP's final loss {row['target']:.4f}; o = {1e3 * row['overhead_s']:.1f} ms/step")
    print(f"    {'method':<7}{'final loss':>11}{'s to target':>24}{'steps/s':>9}{'planned':>9}{'error':>8}")
    for method in ("ddp", "sync", "paced"):
        if method not in runs:
            continue
        rate = row["measured"].get(method, float("nan"))
        plan = row["planned"].get(method)
        error = row["planner_error"].get(method)
        print(
            f"    {method:<7}{runs[method]['curve'][-1][2]:>11.4f}{when(method):>24}{rate:>9.2f}"
            f"{(plan if plan else float('nan')):>9.2f}"
            f"{(100 * error if error is not None else float('nan')):>7.1f}%"
        )
    ratio, met = row["sync_over_paced"], verdicts(row)
    bound = "" if row["sync_reached"] else " (at least: sync did not reach it)"
    text = "-" if ratio is None else f"{ratio:.2f}x{bound}"
    print(
        f"    sync / paced time to DDP's loss: {text} (target {TARGET_SOONER}x: "
        f"{'met' if met['sooner'] else 'MISSED'}); planner within {100 * PLANNER_TARGET:.0f}%: "
        f"{'met' if met['planner'] else 'MISSED'}",
        flush=True,
    )


def run_nodes(nodes: int, real_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    model_bytes = 4.0 * sum(p.numel() for p in make_lm_model(args.width, args.depth).parameters())
    results: dict[str, Any] = {}
    with Cluster(nodes) as cluster:
        cluster.shape(args.bandwidth)
        megabits = measure_link(cluster, 4, 29669)
        print(
            f"\n{nodes} nodes, links shaped to {args.bandwidth} ({megabits:.0f} Mbit/s measured)", flush=True
        )
        for scenario in args.scenarios:
            timing: list[dict[str, Any]] = [{} for _ in range(nodes)]
            runs: dict[str, Any] = {}
            for method in args.methods:
                began = time.monotonic()
                ranks, runs[method] = run_method(cluster, method, scenario, real_ms, args)
                for rank, record in enumerate(ranks):
                    timing[rank][f"{scenario}/{method}"] = record
                steps = [len(r["ends"]) for r in ranks]
                print(
                    f"  {scenario}/{method}: {min(steps)}-{max(steps)} steps per rank, final loss "
                    f"{runs[method]['curve'][-1][2]:.4f} ({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
            row = {**time_to_target(runs), **rates(timing, scenario, nodes, megabits, model_bytes, args)}
            row["runs"] = runs
            row["steps_per_rank"] = {m: [len(t[f"{scenario}/{m}"]["ends"]) for t in timing] for m in runs}
            row["median_step_s"] = {  # each rank's median step time after the first 24 (diagnosis)
                m: [statistics.median(step_seconds(t[f"{scenario}/{m}"])[24:] or [0.0]) for t in timing]
                for m in runs
            }
            row["verdicts"] = verdicts(row)
            print_row(nodes, scenario, row)
            results[scenario] = row
    return {"nodes": nodes, "megabits": megabits, "scenarios": results}


def summary(everything: list[dict[str, Any]]) -> None:
    """One line per node count and scenario: the figures the docs quote."""
    print(
        "\nnodes scenario  DDP loss   DDP s   sync s  paced s  sync/paced  steps/s measured (planned) "
        "ddp, sync, paced"
    )
    for result in everything:
        for scenario, row in result["scenarios"].items():
            hits, runs = row["hits"], row["runs"]

            def seconds(method: str, hits: dict[str, Any] = hits, runs: dict[str, Any] = runs) -> str:
                if hits.get(method) is None:
                    return f">{runs[method]['curve'][-1][1]:.0f}" if method in runs else "-"
                return f"{hits[method][1]:.0f}"

            ratio = row["sync_over_paced"]
            ratio_text = "-" if ratio is None else ("" if row["sync_reached"] else ">") + f"{ratio:.2f}x"
            measured = ", ".join(
                f"{row['measured'][m]:.1f} ({row['planned'].get(m, float('nan')):.1f})"
                for m in row["measured"]
            )
            print(
                f"{result['nodes']:>5} {scenario:<8} {row['target']:>9.4f} {seconds('ddp'):>7} "
                f"{seconds('sync'):>8} {seconds('paced'):>8} {ratio_text:>11}  {measured}"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=["one3x"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--bandwidth", default="200mbit", help="tc rate of every link, both ways")
    parser.add_argument("--compute-ms", type=float, default=150.0, help="a step's compute x the factor")
    parser.add_argument("--gossip", default="ring~h8d1", help="sync and paced: a '~hH' method")
    parser.add_argument("--steps", type=int, default=240, help="DDP's steps (and cosine)")
    parser.add_argument("--budget", type=float, default=2.0, help="gossip: this many times DDP's samples")
    parser.add_argument("--eval-every", type=int, default=8, help="steps (gossip: eval_every / H rounds)")
    parser.add_argument("--nocomm-steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=600.0, help="kill a method's ranks after this")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    spec = parse_method(args.gossip)
    if spec.topology is None or spec.sync_every < 2 or spec.paced:
        parser.error(
            f"--gossip must be low-communication gossip without 'p' ('ring~h8d1'), got {args.gossip!r}"
        )
    args.sync_every = spec.sync_every
    args.shift_s = 0.0  # uneven_fleet's analysis reads it; no scenario here changes speed
    args.port_offset = 0
    for needed in ("nocomm", "ddp"):  # the planner's overhead, and the target
        if needed not in args.methods:
            args.methods.insert(0, needed)
    args.methods = [m for m in METHODS if m in args.methods]
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    real_ms = 1e3 * real_step_seconds(args)
    print(
        f"the model's own step: {real_ms:.1f} ms here (batch {args.batch}); a step's compute "
        f"{args.compute_ms:.0f} ms x the rank's factor, topped up by sleep; {args.gossip}, "
        f"{gossip_rounds(args)} rounds for the gossip methods ({args.budget:g}x the samples of DDP's "
        f"{args.steps} steps)",
        flush=True,
    )
    everything = []
    for nodes in args.nodes:
        everything.append(run_nodes(nodes, real_ms, args))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"args": vars(args), "real_step_ms": real_ms, "results": everything}, indent=1)
            )
    summary(everything)


if __name__ == "__main__":
    main()
