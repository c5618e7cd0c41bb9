"""Time to a fixed validation loss on an emulated slow link: DDP, PowerSGD, torchft's DiLoCo and ours.

    sudo uv run --group bench benchmarks/low_communication/time_to_loss_cluster.py [--json PATH]  # ~45 min
    sudo uv run --group bench benchmarks/low_communication/time_to_loss_cluster.py --nodes 4 --ddp-ratio 48

For every node count of ``--nodes`` (2 and 4; one worker per node, namespaces on a bridge,
``emulated_cluster.py``'s ``Cluster``), the language model of ``lm_task.py`` (AdamW, lr 3e-3, cosine
over ``--steps``, batch 16 per worker, iid windows) is trained with each method, one method at a time,
every rank starting from the same model. A step's compute is ``--compute-ms``: the model's own forward
and backward plus a sleep that tops it up (``harness/lm_worker.py``), so that four nodes fit on two
cores. ``nocomm`` runs first; then every link is shaped so that DDP's ring all-reduce of one fp32
gradient takes ``--ddp-ratio`` (12) times its measured step (DDP then communicates about 10 to 11 times
its compute and update: some of the all-reduce overlaps backward). Every ``--eval-every`` steps each
rank writes its parameters; afterwards the replicas' average is evaluated (256 fixed validation
windows), so the curve costs the run nothing. Reported per method: steps taken, measured and predicted
ms per step, bytes per step, and the first evaluated step and wall-clock second at which the average
model reaches ``--target-loss``; a method that does not reach it within its ``--budget-s`` (its steps
are capped at what the budget allows at its predicted pace) says so.

Methods: ``nocomm`` (the compute and update alone: the planner's compute input), ``ddp``, DDP with
torch's ``powerSGD_hook`` at ranks 1, 2 and 4 (``ddp-psgdR``), torchft's DiLoCo (``torchft~h8``
blocking; ``torchft~h8d7`` with its exchange behind 7 inner steps, which torchft's default
``fragment_update_alpha=0`` then drops; ``torchft~h8d7a0.5``, which keeps half of them; outer SGD lr
0.8 without momentum, the outer rule that trains this model best in ``lm_convergence.py``: DiLoCo's
Nesterov 0.7/0.9 ends at 1.41x DDP's loss there), and ours with ``sync_every=8, sync_delay=1`` on a ring,
uncompressed, int8 and top-k 3% with 4-bit values (``ring~h8d1@topk:0.03:int4``, 1/73 of fp32's
bytes). Targets: ours sparse reaches the loss first, at least 2x sooner than the best PowerSGD run
and than the best torchft run; the planner (``decent_optim_wrapper.plan.predict`` with this
machine's measured round costs, the measured link and the ``nocomm`` step) predicts our
low-communication runs' step time within 15%.

Needs root (network namespaces); without it, it says so and exits 0. torchft comes with the
``bench`` group; without it the torchft methods are skipped. Hold the shared lock
(``flock /tmp/dow-heavy.lock ...``): the cluster's namespaces are removed at start and exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
from benchmarks.harness.lm_worker import POWER_SGD, TORCHFT, power_sgd_numel
from benchmarks.harness.methods import parse_method
from decent_optim_wrapper.engine.wire.compression import GossipCompression, parse_compression
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict
from decent_optim_wrapper.plan.round_cost import RoundCost, measure_round_cost

WORKER = Path(__file__).parents[1] / "harness" / "lm_worker.py"
SPARSE = "ring~h8d1@topk:0.03:int4"
METHODS = [
    "nocomm",
    "ddp",
    "ddp-psgd1",
    "ddp-psgd2",
    "ddp-psgd4",
    "torchft~h8",
    "torchft~h8d7",
    "torchft~h8d7a0.5",
    "ring~h8d1",
    "ring~h8d1@int8",
    SPARSE,
    "ring~h4d1@topk:0.03:int4",
]
TARGET_SOONER, TARGET_PREDICTION = 2.0, 0.15


def engine_overhead_seconds(args: argparse.Namespace, method: str = "ring~h8d1", steps: int = 64) -> float:
    """Seconds per step our optimizer step adds to AdamW's here (the planner's ``overhead_s``): both
    timed on the model's gradients, the wrapper in a world of one rank (no round goes anywhere; what a
    round costs besides is :func:`~decent_optim_wrapper.plan.round_cost.measure_round_cost`'s)."""
    import torch.distributed as dist

    from benchmarks.harness.methods import optimizer_factory
    from decent_optim_wrapper import DecentOptimWrapper

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="dow-ttl-store-"))
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    try:
        means = []
        for wrapped in (False, True):
            model = make_lm_model(args.width, args.depth)
            named = list(model.named_parameters())
            optimizer = optimizer_factory("adamw", 0.0, args.adam_lr)(named)
            if wrapped:
                optimizer = DecentOptimWrapper(optimizer, **parse_method(method).engine_options())
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            for _ in range(8):
                optimizer.step()  # untimed: buckets built, first allocations
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            means.append((time.perf_counter() - start) / steps)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    return max(0.0, means[1] - means[0])


def run_method(
    cluster: Cluster,
    method: str,
    stop_at: int,
    pad_ms: float,
    args: argparse.Namespace,
    deadline_s: float | None = None,
    at_the_gate: Callable[[], None] | None = None,
) -> Path:
    """Train ``method`` on every node; returns the folder of the ranks' files (raises if a rank failed).

    ``args`` carries the worker's flags (``--warmup`` and ``--timeout-s`` too); the run is stopped
    after ``deadline_s`` (default: 1.5 times ``args.budget_s`` and a minute). ``at_the_gate`` runs
    once every rank is built and before any trains (``lm_worker.py --gate``): e.g. shaping the links
    that the start-up crossed at full speed."""
    outdir = Path(tempfile.mkdtemp(prefix="dow-ttl-"))
    procs = []
    args.port_offset = (args.port_offset + 1) % 16  # a fresh port per run: the last run's may linger
    for rank in range(cluster.nodes):
        flags = {
            "--rank": rank,
            "--world-size": cluster.nodes,
            "--method": method,
            "--steps": args.steps,
            "--stop-at": stop_at,
            "--eval-every": args.eval_every,
            "--batch": args.batch,
            "--adam-lr": args.adam_lr,
            "--pad-ms": pad_ms,
            "--width": args.width,
            "--depth": args.depth,
            "--warmup": args.warmup,
            "--timeout-s": args.timeout_s,
            "--outdir": outdir,
        }
        argv = [str(WORKER), *[str(item) for pair in flags.items() for item in pair]]
        if at_the_gate is not None:
            argv.append("--gate")
        env = node_env(cluster, rank, 29681 + args.port_offset)
        procs.append(start_in_node(cluster, rank, argv, env, outdir / f"rank{rank}.log"))
    deadline = time.monotonic() + (args.budget_s * 1.5 + 60 if deadline_s is None else deadline_s)
    gated = at_the_gate is None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            if not gated and all((outdir / f"ready-{r}").exists() for r in range(cluster.nodes)):
                assert at_the_gate is not None
                at_the_gate()
                (outdir / "go").touch()
                gated = True
            time.sleep(0.5)
    finally:
        stop(procs)
    if not all((outdir / f"rank{r}.json").exists() for r in range(cluster.nodes)):
        tail = (outdir / "rank0.log").read_text()[-2000:]
        shutil.rmtree(outdir, ignore_errors=True)
        raise RuntimeError(f"{method}: workers failed or timed out; rank 0's log ends:\n{tail}")
    return outdir


def wire_bytes(method: str, model: nn.Module, nodes: int) -> float:
    """Bytes a rank sends per step with a baseline (a ring all-reduce's count)."""
    allreduce = 2 * (nodes - 1) / nodes
    numel = sum(p.numel() for p in model.parameters())
    power = POWER_SGD.fullmatch(method)
    if power is not None:
        return allreduce * 4 * power_sgd_numel(model, int(power["rank"]))
    torchft = TORCHFT.fullmatch(method)
    return allreduce * 4 * numel / (int(torchft["every"]) if torchft else 1)


def ours(method: str) -> bool:
    """Whether ``method`` is one of ours (``methods.py``'s grammar) rather than a baseline."""
    return method != "nocomm" and not method.startswith(("ddp", "torchft"))


def sparse(method: str) -> bool:
    """Whether ``method`` is ours with a sparse wire format."""
    return ours(method) and "@" in method and parse_compression(method.partition("@")[2]).sparse


def planner_label(method: str) -> str:
    """The planner's name for ``method``: ``ring~h8d1@int8`` (it needs no outer optimizer to time a step)."""
    if not ours(method):
        return method
    spec = parse_method(method)
    delay = spec.sync_every if spec.sync_delay is None else spec.sync_delay
    wire = f"@{spec.compression}" if spec.compression else ""
    return f"{spec.topology}~h{spec.sync_every}d{delay}{wire}"


def predictions(
    methods: list[str],
    model_bytes: float,
    nocomm_s: float,
    megabits: float,
    nodes: int,
    numel: int,
    overhead_s: float,
    message_bytes: float = 0.0,
) -> dict[str, float]:
    """Planner step times (seconds) of DDP and of our methods among ``methods`` on this cluster
    (``message_bytes``: the links' cost per message beyond its payload, ``measure_message_bytes``)."""
    costs: dict[str | None, RoundCost] = {}  # one group size per run

    def round_cost(compression: GossipCompression | None, group_size: int) -> RoundCost:
        key = None if compression is None else compression.name
        if key not in costs:
            costs[key] = measure_round_cost(numel, group_size, compression)
        return costs[key]

    specs = [parse_method(m) for m in methods if ours(m)]
    found = predict(
        model_bytes,
        ComputeTimes(nocomm_s),
        Network(Link(megabits * 1e6, message_bytes=message_bytes)),
        nodes,
        sorted({str(spec.topology) for spec in specs}),
        compressions=sorted({spec.compression for spec in specs if spec.compression}),
        # an unset delay is the library's default, a whole round; 0 (blocking) is kept
        local_steps=sorted(
            {(s.sync_every, s.sync_every if s.sync_delay is None else s.sync_delay) for s in specs}
        ),
        round_costs=round_cost,
        overhead_s=overhead_s,
    )
    return {p.method: p.step_s for p in found}


def run_nodes(nodes: int, pad_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    model = make_lm_model(args.width, args.depth)
    numel = sum(p.numel() for p in model.parameters())
    model_bytes = 4.0 * numel
    compute_s = args.compute_ms / 1e3
    allreduce_bytes = 2 * (nodes - 1) / nodes * model_bytes
    results: dict[str, Any] = {}
    with Cluster(nodes) as cluster:
        print(f"\n{nodes} nodes:", flush=True)
        planned: dict[str, float] = {}
        nocomm_s, rate_kbit, megabits = compute_s, 0, 0.0
        for method in args.methods:  # nocomm first: the link is shaped from its step time
            if method == "nocomm":
                stop_at = min(args.steps, 100)
            else:  # at most the budget at the planned pace, or with nothing hidden behind compute
                unhidden = nocomm_s + wire_bytes(method, model, nodes) * 8 / (megabits * 1e6)
                pace = planned.get(planner_label(method)) or unhidden
                stop_at = min(args.steps, max(args.eval_every, int(args.budget_s / pace)))
                stop_at -= stop_at % args.eval_every
            began = time.monotonic()
            outdir = run_method(cluster, method, stop_at, pad_ms, args)
            try:
                results[method] = evaluate(outdir, nodes, args)
            finally:
                shutil.rmtree(outdir, ignore_errors=True)
            r = results[method]
            print(
                f"  {method:<26} {r['steps']:>4} steps, {r['step_ms']:7.1f} ms/step, final loss "
                f"{r['curve'][-1][2]:.4f} ({time.monotonic() - began:.0f} s)",
                flush=True,
            )
            if method == "nocomm":
                nocomm_s = r["step_ms"] / 1e3
                rate_kbit = int(allreduce_bytes * 8 / (args.ddp_ratio * nocomm_s) / 1e3)
                cluster.shape(f"{rate_kbit}kbit")
                megabits = measure_link(cluster, 2, 29669)
                print(f"  link {rate_kbit} kbit/s shaped, {megabits:.2f} Mbit/s measured", flush=True)
                planned = predictions(
                    args.methods, model_bytes, nocomm_s, megabits, nodes, numel, args.overhead_s
                )
    return {"nodes": nodes, "rate_kbit": rate_kbit, "megabits": megabits, "planned": planned, "runs": results}


def report(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    runs, planned, nodes = result["runs"], result["planned"], result["nodes"]
    base = runs["nocomm"]["step_ms"] if "nocomm" in runs else float("nan")
    ddp_comm = (runs["ddp"]["step_ms"] - base) / base if "ddp" in runs else float("nan")
    print(
        f"\n{nodes} nodes x 1 worker, link {result['megabits']:.2f} Mbit/s: DDP communicates "
        f"{ddp_comm:.1f}x its compute and update ({base:.1f} ms/step without communication); target "
        f"validation loss {args.target_loss}"
    )
    header = (
        f"  {'method':<26}{'steps':>6}{'ms/step':>9}{'planned':>9}{'KB/step':>9}{'final loss':>11}"
        f"{'step to':>8}{'s to':>7}{'vs sparse':>10}"
    )
    print(header)
    hits = {m: reached(r["curve"], args.target_loss) for m, r in runs.items()}
    sparse_hits = sorted((hit[1], m) for m, hit in hits.items() if sparse(m) and hit is not None)
    best_sparse = sparse_hits[0][1] if sparse_hits else next((m for m in runs if sparse(m)), None)
    sparse_hit = None if best_sparse is None else hits[best_sparse]
    times: dict[str, float | None] = {}
    for method, r in runs.items():
        hit = hits[method]
        times[method] = None if hit is None else hit[1]
        plan = planned.get(planner_label(method))
        ratio = hit[1] / sparse_hit[1] if hit and sparse_hit else float("nan")
        last_s = r["curve"][-1][1]
        when = f"{hit[1]:.0f}" if hit else f">{last_s:.0f}"
        print(
            f"  {method:<26}{r['steps']:>6}{r['step_ms']:>9.1f}"
            f"{(1e3 * plan if plan else float('nan')):>9.1f}{r['bytes_sent_per_step'] / 1e3:>9.2f}"
            f"{r['curve'][-1][2]:>11.4f}{(hit[0] if hit else '-'):>8}{when:>7}{ratio:>10.2f}"
        )
    verdicts = []

    def judge(name: str, met: bool) -> None:
        verdicts.append({"nodes": nodes, "target": name, "met": met})
        print(f"  target: {name}: {'met' if met else 'MISSED'}")

    if best_sparse is not None and "nocomm" in runs:
        first = sparse_hit is not None and all(
            t is None or t >= sparse_hit[1] for m, t in times.items() if m not in (best_sparse, "nocomm")
        )
        judge(f"{best_sparse} reaches {args.target_loss} first", first)
        for family in ("ddp-psgd", "torchft"):
            reached_times = [t for m, t in times.items() if m.startswith(family)]
            if not reached_times:
                continue
            best = min((t for t in reached_times if t is not None), default=None)
            met = sparse_hit is not None and (best is None or best >= TARGET_SOONER * sparse_hit[1])
            judge(f"{TARGET_SOONER:g}x sooner than the best {family} run", met)
        for method in runs:
            if ours(method) and "@" in method and planner_label(method) in planned:
                error = abs(1e3 * planned[planner_label(method)] / runs[method]["step_ms"] - 1)
                judge(
                    f"{method} step time predicted within {TARGET_PREDICTION:.0%} ({error:.1%})",
                    error <= 0.15,
                )
    return verdicts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--compute-ms", type=float, default=40.0, help="a step's compute, topped up")
    parser.add_argument("--ddp-ratio", type=float, default=12.0, help="DDP's exchange / a step's compute")
    parser.add_argument("--target-loss", type=float, default=2.2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--budget-s", type=float, default=240.0, help="per method: caps its steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.port_offset, args.warmup, args.timeout_s = 0, 0, 120.0
    if "nocomm" not in args.methods:
        args.methods = ["nocomm", *args.methods]
    args.methods = ["nocomm", *[m for m in args.methods if m != "nocomm"]]  # first: the planner's input
    if importlib.util.find_spec("torchft") is None:
        skipped = [m for m in args.methods if m.startswith("torchft")]
        if skipped:
            print(f"torchft is not installed (uv run --group bench ...): skipping {', '.join(skipped)}")
        args.methods = [m for m in args.methods if not m.startswith("torchft")]
    for method in args.methods:
        if "@" in method:
            parse_compression(method.partition("@")[2])
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    real_ms = 1e3 * real_step_seconds(args)
    pad_ms = max(0.0, args.compute_ms - real_ms)
    print(f"the model's own step: {real_ms:.1f} ms here; topped up with {pad_ms:.1f} ms of sleep")
    args.overhead_s = engine_overhead_seconds(args)
    print(f"our optimizer step adds {1e3 * args.overhead_s:.2f} ms to AdamW's here (the planner's overhead)")
    everything = []
    for nodes in args.nodes:
        result = run_nodes(nodes, pad_ms, args)
        result["verdicts"] = report(result, args)
        everything.append(result)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"real_step_ms": real_ms, "overhead_s": args.overhead_s, "results": everything}, indent=1
                )
            )


if __name__ == "__main__":
    main()
