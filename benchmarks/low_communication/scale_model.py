"""The slow-link run at scale-model size: 16 emulated nodes on links that move one fp32 model per 320 steps.

    sudo uv run --group bench benchmarks/low_communication/scale_model.py [--json PATH]   # ~40 min
    sudo uv run --group bench benchmarks/low_communication/scale_model.py --nodes 4 --baselines ddp

The full-size job it scales down: a 1B-parameter model (4 GB in fp32) on 16 nodes of 8 GPUs, about a
second per step, joined by 100 Mbit/s links, over which one fp32 copy of the model takes about 320 s:
**the link moves one fp32 model per 320 steps' compute**. Here the language model of ``lm_task.py``
(AdamW, ``--warmup`` steps of linear warmup then a cosine over ``--steps``, batch ``--batch`` per
node, iid windows) trains on ``--nodes`` network namespaces on a bridge (``emulated_cluster.py``), one
worker per node, every rank from the same model. A step's compute is ``--compute-ms`` (the model's
own forward and backward topped up by sleep, ``harness/lm_worker.py``, so that 16 nodes fit on two
cores): 400 ms by default, where the 16 workers' real compute (about 27 ms each) leaves the two cores
about a quarter busy; at 150 ms they are 84% busy and every round's encoding competes with the
compute, which a GPU node's CPU does not. The no-communication run comes first; then every link is
shaped so that one fp32 model takes ``--link-steps`` (320) of its steps, the same ratio as the
full-size job, and two probes measure it: its goodput (one TCP stream) and what a small all-reduce's
message costs beyond its payload (``measure_message_bytes``: headers, acknowledgements, gloo's own
messages), both handed to the planner.

What runs where:

* ``nocomm``: the compute and update alone (unshaped), the throughput reference;
* the baselines, whose loss does not depend on the link (``ddp``, DDP with torch's ``powerSGD_hook``
  ``ddp-psgdR``, torchft's DiLoCo ``torchft~hH`` blocking, outer SGD lr 0.8): trained in full on the
  unshaped links for their loss curves (a small documented sweep: PowerSGD ranks, DiLoCo's period),
  then timed over a few steps on the shaped links (DDP and PowerSGD: ``--timed-steps`` after
  PowerSGD's two uncompressed steps; torchft: one whole period, its exchange included); their time to a
  loss is the step at which they reach it times that step time;
* ours (``--ours``, default the planner's recommendation for this cluster, see below): trained in full
  on the shaped links, its curve in the run's own seconds.

Every ``--eval-every`` steps each rank writes its parameters; the replicas' average is evaluated
afterwards (256 fixed validation windows), so the curve costs a run nothing. Reported: each method's
step time on the shaped links, its throughput against ``nocomm``, its final validation loss at equal
samples against DDP's, its time to DDP's final loss and to the loss every method reaches (the highest
final loss among them), and the bytes a node sends per step: counted (the engine's
``bytes_sent_per_step``, the all-reduce cost model for the baselines) and on the wire (the node's link
counters from the gate on, divided by its steps: headers, acknowledgements and gloo's own messages
included). Targets,
marked met or MISSED: ours at least 0.90 of no communication's throughput, its final loss at most 1.02x
DDP's, ahead of the best PowerSGD and the best torchft run in time to DDP's loss (and, reported
beside it, in time to the loss every method reaches), and its step time predicted by the planner
(``decent_optim_wrapper.plan.predict`` with the measured link and message cost, the ``nocomm`` step
and this machine's round costs) within 15%. ``--reuse JSON METHOD`` takes a method's curve from an
earlier run with the same training flags instead of training it. The planner's throughput of the
same setting on the full-size job is printed beside it (``--full-size``: bytes, step ms, link, nodes).

Needs root (network namespaces); without it, it says so and exits 0. torchft comes with the
``bench`` group; without it the torchft methods are skipped. Hold the shared lock
(``flock /tmp/dow-heavy.lock ...``): the cluster's namespaces are removed at start and exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.emulated_cluster import Cluster, measure_link, measure_message_bytes, ready_to_emulate
from benchmarks.harness.lm_snapshots import evaluate, reached, real_step_seconds
from benchmarks.harness.lm_task import make_lm_model
from benchmarks.harness.lm_worker import POWER_SGD, TORCHFT
from benchmarks.harness.methods import parse_method
from benchmarks.low_communication.time_to_loss_cluster import (
    engine_overhead_seconds,
    ours,
    planner_label,
    predictions,
    run_method,
    wire_bytes,
)
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict
from decent_optim_wrapper.plan.cli import parse_quantity
from decent_optim_wrapper.plan.recommend import recommend

BASELINES = ["ddp", "ddp-psgd1", "ddp-psgd4", "torchft~h8", "torchft~h32"]
TARGET_THROUGHPUT, TARGET_LOSS, TARGET_PREDICTION = 0.90, 1.02, 0.15
MTU_FRAME = 1514  # bytes of one Ethernet frame: the shaped links' token bucket holds four


def recommended(
    model_bytes: float, step_s: float, megabits: float, message_bytes: float, nodes: int, topology: str
) -> str:
    """The planner's recommendation for this cluster, in the benchmarks' method grammar."""
    link = Link(megabits * 1e6, message_bytes=message_bytes)
    found = recommend(model_bytes, ComputeTimes(step_s), Network(link), nodes, topology)
    if not found.hides:
        raise RuntimeError(f"the planner hides no setting on {megabits * 1e3:.1f} kbit/s: pass --ours")
    return found.chosen.method


def step_seconds(outdir: Path, nodes: int, skip: int) -> float:
    """Mean seconds per step on the slowest rank, leaving out the first ``skip`` steps."""
    means = []
    for rank in range(nodes):
        record = json.loads((outdir / f"rank{rank}.json").read_text())
        ends = [record["start"], *record["ends"]]
        intervals = [b - a for a, b in itertools.pairwise(ends)][skip:]
        means.append(statistics.fmean(intervals))
    return max(means)


def timed_steps(method: str, args: argparse.Namespace) -> tuple[int, int]:
    """(steps to run, steps to leave out) when timing a baseline on the shaped links."""
    if POWER_SGD.fullmatch(method):
        return 2 + args.timed_steps, 2  # torch all-reduces the first two steps in full
    torchft = TORCHFT.fullmatch(method)
    if torchft is not None:
        return int(torchft["every"]), 0  # one whole period: H inner steps, one exchange
    return args.timed_steps, 0


def train(
    cluster: Cluster,
    method: str,
    stop_at: int,
    pad_ms: float,
    args: argparse.Namespace,
    deadline_s: float,
    shape: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One run of ``method``: its evaluated curve and the folder's step times. With ``shape``, the
    workers start on fast links, which ``shape`` slows once all are built (the start-up's broadcast
    and connections are not what the run measures); the links' counters start there too."""
    began, counted = time.monotonic(), [cluster.sent_bytes()]

    def at_the_gate() -> None:
        assert shape is not None
        shape()
        counted[0] = cluster.sent_bytes()

    try:
        outdir = run_method(
            cluster, method, stop_at, pad_ms, args, deadline_s, None if shape is None else at_the_gate
        )
        wire = (cluster.sent_bytes() - counted[0]) / cluster.nodes / stop_at
    finally:
        if shape is not None:
            cluster.shape(None)  # the next run starts on fast links again, also after a failed one
    try:
        result = evaluate(outdir, cluster.nodes, args) if stop_at >= args.eval_every else {}
        result["timed_s"] = step_seconds(outdir, cluster.nodes, timed_steps(method, args)[1])
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    result["wall_s"] = time.monotonic() - began
    result["wire_bytes_per_step"] = wire  # the run's whole traffic per node over its steps
    return result


#: The flags a loss curve depends on: an earlier run's curve is reused only if they are the same.
TRAINING_FLAGS = ("nodes", "steps", "warmup", "eval_every", "batch", "adam_lr", "width", "depth")
#: What a run's timing is measured in: an earlier run's times are kept only if these are the same.
TIMING_FLAGS = ("compute_ms", "link_steps")
TIMES = ("shaped_step_s", "step_ms", "timed_s", "wall_s", "wire_bytes_per_step")


def reused_run(path: Path, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """``method``'s run from the JSON of an earlier run at ``path`` (a ValueError says why not)."""
    earlier = json.loads(path.read_text())
    if method not in earlier["runs"]:
        raise ValueError(f"{path} has no run of {method!r}; it has {', '.join(earlier['runs'])}")
    differ = [
        f"--{key.replace('_', '-')} {earlier['args'].get(key)} (here {getattr(args, key)})"
        for key in TRAINING_FLAGS
        if earlier["args"].get(key) != getattr(args, key)
    ]
    if differ:
        raise ValueError(f"{path} trained with {', '.join(differ)}: its curve is not this run's")
    record = dict(earlier["runs"][method], reused_from=str(path))
    if any(earlier["args"].get(k) != getattr(args, k) for k in TIMING_FLAGS):
        for key in TIMES:
            record.pop(key, None)
    return record


def run(args: argparse.Namespace, pad_ms: float) -> dict[str, Any]:
    nodes = args.nodes
    model = make_lm_model(args.width, args.depth)
    numel = sum(p.numel() for p in model.parameters())
    model_bytes = 4.0 * numel
    runs: dict[str, dict[str, Any]] = {}
    unshaped_s = args.steps * args.compute_ms / 1e3 * 4 + 900  # generous: 16 starts on 2 cores are slow
    with Cluster(nodes) as cluster:
        print(f"\n{nodes} nodes, {numel:,} parameters ({model_bytes / 1e6:.2f} MB in fp32)", flush=True)
        runs["nocomm"] = train(cluster, "nocomm", min(100, args.steps), pad_ms, args, unshaped_s)
        nocomm_s = runs["nocomm"]["step_ms"] / 1e3
        print(f"  nocomm: {1e3 * nocomm_s:.1f} ms/step ({runs['nocomm']['wall_s']:.0f} s)", flush=True)
        runs.update(args.reused)
        for method in args.baselines:  # their loss does not depend on the link: curves on fast links
            runs[method] = train(cluster, method, args.steps, pad_ms, args, unshaped_s)
            save_partial(args, runs)
            print(
                f"  {method} (unshaped): final loss {runs[method]['curve'][-1][2]:.4f} "
                f"({runs[method]['wall_s']:.0f} s)",
                flush=True,
            )
        rate_bits = model_bytes * 8 / (args.link_steps * nocomm_s)

        def shape() -> None:
            cluster.shape(f"{int(rate_bits)}bit", burst=4 * MTU_FRAME, latency=f"{args.queue_s:g}s")

        shape()
        probe_mb = rate_bits / 8 * 20 / 1e6  # 20 s of the link
        megabits = measure_link(cluster, probe_mb, 29669, timeout_s=120)
        # a round of what the link moves in one step, as a pair's all-reduce sends it
        round_bytes = int(model_bytes / args.link_steps)
        message_bytes = measure_message_bytes(cluster, round_bytes, 29670, megabits * 1e6 / rate_bits)
        cluster.shape(None)
        print(
            f"  links shaped to {rate_bits / 1e3:.1f} kbit/s ({megabits * 1e3:.1f} kbit/s measured): "
            f"one fp32 model per {args.link_steps:g} steps; an all-reduce's message costs "
            f"{message_bytes:.0f} bytes beyond its payload ({round_bytes} bytes per round)",
            flush=True,
        )
        chosen = args.ours or recommended(
            model_bytes, nocomm_s, megabits, message_bytes, nodes, args.topology
        )
        method = chosen if "+" not in chosen else chosen.partition("+")[0]
        runs[method] = train(cluster, method, args.steps, pad_ms, args, unshaped_s * 2, shape)
        r = runs[method]
        print(
            f"  {method} (shaped): {r['step_ms']:.1f} ms/step, final loss {r['curve'][-1][2]:.4f} "
            f"({r['wall_s']:.0f} s)",
            flush=True,
        )
        planned = predictions(
            [method], model_bytes, nocomm_s, megabits, nodes, numel, args.overhead_s, message_bytes
        )
        for baseline in args.baselines:
            save_partial(args, runs)
            steps, _ = timed_steps(baseline, args)
            unhidden = wire_bytes(baseline, model, nodes) * 8 / (megabits * 1e6) + nocomm_s
            try:
                timing = train(cluster, baseline, steps, pad_ms, args, steps * unhidden * 3 + 900, shape)
            except RuntimeError as err:  # its loss stands; a run that cannot be timed loses nothing else
                for key in TIMES:  # its times on the fast links are not the shaped links'
                    runs[baseline].pop(key, None)
                runs[baseline]["not_timed"] = str(err).splitlines()[0]
                print(f"  {baseline} (shaped): not timed: {runs[baseline]['not_timed']}", flush=True)
                continue
            runs[baseline]["shaped_step_s"] = timing["timed_s"]
            print(
                f"  {baseline} (shaped): {1e3 * timing['timed_s']:.0f} ms/step over {steps} steps "
                f"({timing['wall_s']:.0f} s)",
                flush=True,
            )
    return {
        "nodes": nodes,
        "parameters": numel,
        "rate_bits": rate_bits,
        "megabits": megabits,
        "message_bytes": message_bytes,
        "ours": method,
        "planned_s": planned.get(planner_label(method)),
        "full_size": full_size(method, args),
        "runs": runs,
    }


def save_partial(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    """Write the runs so far to ``--json`` (``"partial": true``): an hour of runs is not lost to a
    later one that fails or is stopped. The finished run overwrites it."""
    if args.json:
        Path(args.json).write_text(json.dumps({"partial": True, "args": vars(args), "runs": runs}, indent=1))


def full_size(method: str, args: argparse.Namespace) -> dict[str, float]:
    """The planner's throughput of ``method`` on the full-size job (no measured round costs there)."""
    size, step_ms, link, nodes = args.full_size
    spec = parse_method(method)
    delay = spec.sync_every if spec.sync_delay is None else spec.sync_delay
    found = predict(
        parse_quantity(size, "bytes"),
        ComputeTimes(float(step_ms) / 1e3),
        Network(Link(parse_quantity(link, "bandwidth"))),
        int(nodes),
        [str(spec.topology)],
        compressions=[spec.compression] if spec.compression else [],
        local_steps=[(spec.sync_every, delay)],
    )
    by_name = {p.method: p.step_s for p in found}
    nocomm = by_name["nocomm"]
    return {
        "model_bytes": parse_quantity(size, "bytes"),
        "step_s": float(step_ms) / 1e3,
        "link_bits": parse_quantity(link, "bandwidth"),
        "nodes": int(nodes),
        "throughput": nocomm / by_name[planner_label(method)],
        "ddp_throughput": nocomm / by_name["ddp"],
    }


def seconds_to(run: dict[str, Any], loss: float) -> tuple[int | None, float | None]:
    """The first evaluated step at which ``run``'s average is at ``loss`` or below, and the seconds to it
    on the shaped links: a baseline's steps at its pace timed there, ours its own clock (None: never,
    or a reused run without times)."""
    hit = reached(run["curve"], loss)
    if hit is None:
        return None, None
    if "shaped_step_s" in run:
        return hit[0], hit[0] * run["shaped_step_s"]
    return hit[0], (hit[1] if "step_ms" in run else None)


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}"


def report(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    runs, method, nodes = result["runs"], result["ours"], result["nodes"]
    nocomm_ms = runs["nocomm"]["step_ms"]
    ddp = runs.get("ddp")
    ddp_final = ddp["curve"][-1][2] if ddp else float("nan")
    print(
        f"\n{nodes} nodes x 1 worker, {result['parameters']:,} parameters, links "
        f"{result['megabits'] * 1e3:.1f} kbit/s (one fp32 model per {args.link_steps} steps of "
        f"{nocomm_ms:.0f} ms): {args.steps} steps of batch {args.batch} per node, AdamW lr {args.adam_lr}, "
        f"{args.warmup} warmup steps + cosine; DDP's final validation loss {ddp_final:.4f}"
    )
    # the loss every method reaches: the highest final loss among them
    common = max(r["curve"][-1][2] for name, r in runs.items() if name != "nocomm")
    print(
        f"  {'method':<36}{'ms/step':>10}{'/ nocomm':>9}{'final loss':>11}{'vs DDP':>8}"
        f"{'step to DDP':>12}{'s to DDP':>10}{'s to common':>12}{'B/step':>9}{'on wire':>9}"
    )
    times: dict[str, float | None] = {}
    to_common: dict[str, float | None] = {}
    rows = []
    for name, r in runs.items():
        if name == "nocomm":
            continue
        # a reused run measured in other units of time has none
        shaped_ms = 1e3 * r["shaped_step_s"] if "shaped_step_s" in r else r.get("step_ms", math.nan)
        step, seconds = seconds_to(r, ddp_final)
        times[name] = seconds
        to_common[name] = seconds_to(r, common)[1]
        bytes_step = r.get("bytes_sent_per_step") or wire_bytes(
            name, make_lm_model(args.width, args.depth), nodes
        )
        final = r["curve"][-1][2]
        row = {
            "method": name,
            "step_ms": shaped_ms,
            "throughput": nocomm_ms / shaped_ms,
            "final_loss": final,
            "vs_ddp": final / ddp_final,
            "step_to_ddp": step,
            "seconds_to_ddp": seconds,
            "seconds_to_common": to_common[name],
            "bytes_per_step": bytes_step,
            "wire_bytes_per_step": r.get("wire_bytes_per_step"),
            "not_timed": r.get("not_timed"),
        }
        rows.append(row)
        label = f"{name} (reused)" if "reused_from" in r else name
        print(
            f"  {label:<36}{shaped_ms:>10.1f}{row['throughput']:>9.3f}{final:>11.4f}{row['vs_ddp']:>8.4f}"
            f"{'never' if step is None else step:>12}{_seconds(seconds):>10}{_seconds(to_common[name]):>12}"
            f"{bytes_step:>9.0f}{r.get('wire_bytes_per_step', float('nan')):>9.0f}"
        )
    verdicts: list[dict[str, Any]] = []

    def judge(name: str, met: bool) -> None:
        verdicts.append({"target": name, "met": met})
        print(f"  target: {name}: {'met' if met else 'MISSED'}")

    ours_row = next(row for row in rows if row["method"] == method)
    judge(
        f"{method} at least {TARGET_THROUGHPUT:.2f} of no communication ({ours_row['throughput']:.3f})",
        ours_row["throughput"] >= TARGET_THROUGHPUT,
    )
    judge(
        f"{method} final loss at most {TARGET_LOSS:.2f}x DDP's ({ours_row['vs_ddp']:.4f}x)",
        ours_row["vs_ddp"] <= TARGET_LOSS,
    )
    # DDP's loss, then the weaker claim for when no method reaches it: the loss every method reaches
    for goal, seconds_by in (("DDP's loss", times), (f"every method's final loss, {common:.4f},", to_common)):
        mine = seconds_by[method]
        for family in ("ddp-psgd", "torchft"):
            theirs = [t for m, t in seconds_by.items() if m.startswith(family)]
            if theirs:
                best = min((t for t in theirs if t is not None), default=None)
                judge(
                    f"{method} reaches {goal} before the best {family} run",
                    mine is not None and (best is None or mine < best),
                )
    if result["planned_s"] is not None:
        error = 1e3 * result["planned_s"] / ours_row["step_ms"] - 1
        judge(
            f"{method} step time predicted within {TARGET_PREDICTION:.0%} "
            f"({1e3 * result['planned_s']:.1f} ms planned, {error:+.1%})",
            abs(error) <= TARGET_PREDICTION,
        )
    full = result["full_size"]
    print(
        f"  the planner on the full-size job ({full['model_bytes'] / 1e9:g} GB, {1e3 * full['step_s']:.0f} "
        f"ms/step, {full['link_bits'] / 1e6:g} Mbit/s, {full['nodes']} nodes): {method} at "
        f"{full['throughput']:.3f} of no communication, DDP at {full['ddp_throughput']:.4f}"
    )
    result["rows"] = rows
    result["common_loss"] = common
    return verdicts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--link-steps", type=float, default=320.0, help="steps' compute per fp32 model")
    parser.add_argument("--ours", default=None, help="our method (default: the planner's recommendation)")
    parser.add_argument("--topology", default="one-peer-exp", help="the planner's topology for --ours")
    parser.add_argument("--baselines", nargs="*", default=BASELINES)
    parser.add_argument("--timed-steps", type=int, default=2, help="baselines' steps timed on the slow links")
    parser.add_argument(
        "--queue-s",
        type=float,
        default=10.0,
        help="seconds a packet may queue at a shaped link (a 100 ms queue at 47 kbit/s dropped the start-up)",
    )
    parser.add_argument(
        "--compute-ms", type=float, default=400.0, help="a step's compute, topped up (default 400)"
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--full-size",
        nargs=4,
        default=["4G", "1000", "100mbit", "16"],
        metavar=("BYTES", "STEP_MS", "LINK", "NODES"),
        help="the job the run scales down, for the planner's extrapolation",
    )
    parser.add_argument(
        "--reuse",
        nargs=2,
        action="append",
        default=[],
        metavar=("JSON", "METHOD"),
        help="METHOD's loss curve from an earlier run's JSON with the same training flags, neither trained "
        "nor timed here (its step time kept only if that run had the same --compute-ms and --link-steps)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.reused = {method: reused_run(Path(path), method, args) for path, method in args.reuse}
    except ValueError as err:
        parser.error(f"--reuse: {err}")
    args.port_offset, args.budget_s = 0, 0.0
    args.timeout_s = 1800.0  # one DDP all-reduce takes minutes on these links
    if importlib.util.find_spec("torchft") is None:
        skipped = [m for m in args.baselines if m.startswith("torchft")]
        if skipped:
            print(f"torchft is not installed (uv run --group bench ...): skipping {', '.join(skipped)}")
        args.baselines = [m for m in args.baselines if not m.startswith("torchft")]
    if args.ours is not None and not ours(args.ours):
        parser.error(
            f"--ours {args.ours!r}: one of our methods in methods.py's grammar (ring~h2@topk:0.01:int2)"
        )
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    real_ms = 1e3 * real_step_seconds(args)
    pad_ms = max(0.0, args.compute_ms - real_ms)
    print(
        f"the model's own step: {real_ms:.1f} ms here (batch {args.batch}); topped up with {pad_ms:.1f} ms "
        "of sleep"
    )
    args.overhead_s = engine_overhead_seconds(args)
    result = run(args, pad_ms)
    result["verdicts"] = report(result, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"real_step_ms": real_ms, "overhead_s": args.overhead_s, "args": vars(args), **result},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
