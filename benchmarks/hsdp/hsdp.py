"""Decentralized HSDP against torch's HSDP: memory per rank, and step time on an emulated cluster.

Decentralized HSDP shards each replica of the model over the ranks of a node with FSDP2's
``fully_shard`` (mesh dimension ``"shard"``) and gossips every shard with the ranks holding the same
shard in the other replicas (``DecentOptimWrapper(..., device_mesh=mesh["replicate"])``). torch's HSDP
(``fully_shard`` over the 2-D mesh) reduce-scatters the gradients inside the node the same way, then
all-reduces each gradient shard across the replicas in every backward. The question is what sharding
saves in memory against whole-replica gossip, and what gossip saves in time against torch's HSDP when
the link between nodes is the bottleneck. Two parts, in one run:

1. Memory (no root; processes on loopback): the same MLP (7.36M fp32 parameters by default) trained
   a few steps with AdamW as whole replicas with gossip (``whole``: no mesh, 2 ranks), sharded with
   gossip (``gossip-hsdp``: 2 replicas x 2 shards, 4 ranks) and with torch's HSDP (the same mesh);
   ``@bf16`` gossip variants beside them. A CPU has no ``max_memory_allocated``, so two things are
   reported per rank. *Tensors held*, counted after a step from the objects themselves: parameter
   storages (local shards), gradients, the optimizer's state, the engine's bucket copies (storages not
   already counted: whole replicas' parameters are views of the buckets, sharded ones are copied in)
   and the gossip buffers the engine's public ``state_dict()`` shows (the received sums, and with
   compression the gathered payloads and references). It misses transients (FSDP2's all-gathered
   layers, the optimizer's temporaries). *RSS growth*, after the last step and at peak
   (``ru_maxrss``), over the resident size once a warm-up run of the same configuration on a tiny
   model has loaded everything lazy: transients included. It follows the tensors only because glibc
   is told to map every allocation of 128 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``) and so
   to give it back when freed; with its adaptive default the memory FSDP2 frees stays in the heap and
   every configuration's RSS grows step after step, to ~2x its tensors.
2. Emulated cluster (needs root; without it, it says so and exits 0): ``--nodes`` network namespaces
   on a bridge (``emulated_cluster.Cluster``), every node's link shaped with ``tc tbf`` to ``--bandwidth``
   both ways, ``--shards`` ranks per node talking to each other over the node's own address (loopback,
   unshaped). Global ranks ``shards * n ...`` live on node ``n``; the mesh is (nodes, shards), so the
   shard groups are the nodes and each replicate group has one rank per node. Forward and backward
   are sleeps (``emulated_compute.EmulatedMLP``: real parameters, bytes, collectives and optimizer steps), so
   that 8 processes fit on 2 cores. Methods: ``fsdp`` (sharded inside the node, replicas never talk:
   the floor), ``torch-hsdp``, and gossip HSDP ``topology[@compression]``. Per method: median step
   time, torch's HSDP's over it, a rank's CPU per step, and the bytes per step each rank sends over
   the slow link, counted (gossip: ``engine.bytes_sent_per_step()``; torch's HSDP: a ring all-reduce
   of the rank's fp32 gradient shard among the R replicas, ``2 (R - 1) / R`` shard bytes) and measured
   (the node veths' ``tx_bytes`` per step over the shards).

   Defaults: an MLP 512-512-512-10 (0.53M parameters, 2.12 MB, a shard of 1.06 MB), 400 ms of
   compute, links of 40 Mbit/s: the node's two shards cross its link in 424 ms, about one step's
   compute. Why so small a model and so long a step: the emulation's cost is CPU the 8 ranks share
   on 2 cores. FSDP2's hooks, its gathers and reduce-scatters over loopback, DTensor dispatch and the
   optimizer took ~40 ms of CPU per rank and step even at 0.13M parameters and ~85 ms at 1.6M, so with
   a 200 ms step the machine, not the link, set the pace (``fsdp`` alone took 350 ms at 1.6M).

Beside the measured times, the planner's (``python -m decent_optim_wrapper.plan``) predictions for the
shard: ``--model-bytes`` the shard's bytes, ``--nodes`` the replicas, and the link rate divided by the
shards, since the node's ranks all exchange their shards over the one link at the same time. The
planner has no HSDP: torch's HSDP is predicted as its DDP on the shard bytes (a bucketed ring
all-reduce during backward, as FSDP2 all-reduces each layer's shard), ``fsdp`` as its no-communication
step; FSDP2's intra-node work is not in it, so a second column adds the measured ``fsdp`` step's
excess over the compute as per-step overhead.

    uv run benchmarks/hsdp/hsdp.py                       # both parts (the cluster one needs root)
    uv run benchmarks/hsdp/hsdp.py --part memory --json memory.json

The default run takes about 7 minutes on a 2-core VM (memory ~2.5, cluster ~4.5); every run of
workers has a deadline, and the namespaces are removed on exit, error or Ctrl-C
(``emulated_cluster.Cluster``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster_worker import parse_gossip_method
from benchmarks.harness.common import free_port
from benchmarks.harness.emulated_cluster import (
    Cluster,
    measure_link,
    rate_bits,
    ready_to_emulate,
    run_workers,
    stop,
)
from benchmarks.harness.emulated_compute import ROWS
from benchmarks.harness.methods import COMPRESSIONS
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict

WORKER = Path(__file__).with_name("hsdp_worker.py")
MEMORY_CONFIGS = ("whole", "whole@bf16", "gossip-hsdp", "gossip-hsdp@bf16", "torch-hsdp")
CLUSTER_METHODS = ("fsdp", "torch-hsdp", "ring", "one-peer-exp", "ring@bf16")
REFERENCE = "torch-hsdp"
#: The planner's names for the methods that are not gossip (see the module docstring).
PLANNER_NAMES = {"torch-hsdp": "ddp", "fsdp": "nocomm"}
MMAP_THRESHOLD = 128 * 1024
HELD_COLUMNS = ("params", "grads", "optimizer_state", "engine_copy", "gossip_buffers", "total")


# -- part 1: memory ------------------------------------------------------------------------------------


def memory_world_size(config: str, replicas: int, shards: int) -> int:
    """Ranks of a memory configuration: one per whole replica, or replicas x shards."""
    return replicas if config.startswith("whole") else replicas * shards


def run_memory_config(config: str, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every rank of one configuration on loopback; their results, or None (failed or past the deadline)."""
    world = memory_world_size(config, args.replicas, args.shards)
    outdir = Path(tempfile.mkdtemp(prefix="dow-hsdp-"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    # glibc maps every allocation of 128 KiB or more on its own and unmaps it when freed, so that the
    # resident size follows the live tensors (hsdp_worker.memory_run).
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    flags = ["--config", config, "--world-size", world, "--shards", args.shards, "--inputs", args.mem_inputs]
    flags += ["--width", args.mem_width, "--depth", args.mem_depth, "--batch", args.mem_batch]
    flags += ["--steps", args.mem_steps]
    procs = []
    try:
        for rank in range(world):
            command = [sys.executable, str(WORKER), "memory", *map(str, flags), "--rank", str(rank)]
            command += ["--out", str(outdir / f"rank{rank}.json")]
            with open(outdir / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + args.memory_seconds
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        timed_out = time.monotonic() >= deadline
        stop(procs)
        written = [outdir / f"rank{r}.json" for r in range(world)]
        if not all(path.exists() for path in written):
            failed = next((r for r, p in enumerate(procs) if p.returncode != 0), 0)
            tail = (outdir / f"rank{failed}.log").read_text()[-800:]
            status = f"timed out after {args.memory_seconds:.0f} s" if timed_out else "failed"
            print(f"  {config}: {status}; rank {failed} log tail:\n{tail}")
            return None
        return [json.loads(path.read_text()) for path in written]
    finally:
        stop(procs)
        shutil.rmtree(outdir, ignore_errors=True)


def memory_rows(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per configuration: the largest rank's bytes of each kind, its RSS growth after a step and at peak."""
    rows = {}
    for config, ranks in results.items():
        row = {kind: max(r["held"][kind] for r in ranks) for kind in HELD_COLUMNS}
        row["rss_growth"] = max(r["rss_growth"] for r in ranks)
        row["peak_rss_growth"] = max(r["peak_rss_growth"] for r in ranks)
        row["ranks"] = len(ranks)
        rows[config] = row
    return rows


def memory_table(rows: dict[str, dict[str, float]], reference: str = "whole") -> list[str]:
    """MB per rank by kind, the RSS growth after a step and at peak; totals and peaks over ``reference``'s."""
    names = ("params", "grads", "opt state", "engine copy", "gossip buf", "tensors", f"/ {reference}")
    names += ("RSS after", "RSS peak", f"/ {reference}")
    lines = [f"{'config':<18}{'ranks':>6}" + "".join(f"{n:>12}" for n in names)]
    base = rows.get(reference)
    for config, row in rows.items():
        cells = [f"{row[kind] / 1e6:.1f}" for kind in HELD_COLUMNS]
        cells.append(f"{row['total'] / base['total']:.3f}" if base else "-")
        cells += [f"{row['rss_growth'] / 1e6:.1f}", f"{row['peak_rss_growth'] / 1e6:.1f}"]
        cells.append(f"{row['peak_rss_growth'] / base['peak_rss_growth']:.3f}" if base else "-")
        lines.append(f"{config:<18}{row['ranks']:>6}" + "".join(f"{c:>12}" for c in cells))
    return lines


def memory_part(args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"memory: MLP {args.mem_inputs}-{args.mem_width}x{args.mem_depth - 1}-10, AdamW, "
        f"{args.mem_steps} steps of batch {args.mem_batch}; {args.replicas} replicas x {args.shards} shards "
        f"(whole: {args.replicas} ranks); gloo on loopback",
        flush=True,
    )
    results = {}
    for config in args.memory_configs:
        started = time.monotonic()
        ranks = run_memory_config(config, args)
        if ranks is not None:
            results[config] = ranks
            print(f"  {config}: {time.monotonic() - started:.0f} s", flush=True)
    rows = memory_rows(results)
    params = next((r[0]["params"] for r in results.values()), 0)
    model = f"model {params / 1e6:.2f}M params = {4 * params / 1e6:.1f} MB fp32"
    print(f"\nper-rank memory, MB (largest rank; {model})")
    for line in memory_table(rows):
        print(line)
    print(
        "tensors: storages held after a step (params: parameters or their local shards; engine copy:\n"
        "bucket storages not already counted; gossip buf: the engine state_dict()'s received sums,\n"
        "payloads and references); transients not included. RSS after / peak: resident size after the\n"
        "last step / ru_maxrss, minus the resident size before the model was built (after a warm-up run\n"
        f"of a tiny model), with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: transients (FSDP2's gathered\n"
        "layers, the optimizer's temporaries), non-tensor memory and what state_dict() does not show\n"
        "(with compression, the engine's staging and decoding scratch) included."
    )
    return {"rows": rows, "ranks": results}


# -- part 2: emulated cluster ---------------------------------------------------------------------------


def worker_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What ``emulated_cluster.run_workers`` reads: nodes, ranks per node (the shards), rounds, methods."""
    return argparse.Namespace(
        nodes=args.nodes,
        workers_per_node=args.shards,
        rounds=args.rounds,
        batch=ROWS,
        iters=args.iters,
        warmup=args.warmup,
        methods=list(args.methods),
    )


def worker_flags(args: argparse.Namespace) -> list[str]:
    """``cluster_worker``'s flags that ``emulated_cluster.worker_command`` leaves out: the emulated model."""
    flags = ["--inputs", args.inputs, "--width", args.width, "--depth", args.depth, "--compute", "emulated"]
    flags += ["--compute-ms", args.compute_ms, "--forward-fraction", args.forward_fraction]
    return [str(f) for f in flags]


def planner_predictions(
    methods: list[str],
    shard_bytes: float,
    compute_ms: float,
    bandwidth: str,
    replicas: int,
    shards: int,
    forward_fraction: float,
    overhead_ms: float = 0.0,
) -> dict[str, float]:
    """The planner's step time (ms) for each method, on the shard (see the module docstring)."""
    gossip = [parse_gossip_method(m) for m in methods if m not in PLANNER_NAMES]
    compressions = sorted({c for _, _, c in gossip if c})
    network = Network(Link(rate_bits(bandwidth) / shards))
    predictions = predict(
        shard_bytes,
        ComputeTimes(compute_ms / 1e3, "none"),
        network,
        replicas,
        topologies=sorted({t for t, _, _ in gossip}) or None,
        compressions=compressions,
        overhead_s=overhead_ms / 1e3,
        forward_fraction=forward_fraction,
    )
    by_name = {p.method: 1e3 * p.step_s for p in predictions}
    return {m: by_name[PLANNER_NAMES.get(m, m)] for m in methods}


def planner_command(shard_bytes: float, args: argparse.Namespace) -> str:
    """The command line that prints the same predictions (overhead 0)."""
    per_rank = rate_bits(args.bandwidth) / args.shards / 1e6
    topologies = sorted({parse_gossip_method(m)[0] for m in args.methods if m not in PLANNER_NAMES})
    return (
        f"python -m decent_optim_wrapper.plan --model-bytes {int(shard_bytes)} "
        f"--compute-ms {args.compute_ms:g} --bandwidth {per_rank:g}mbit --nodes {args.nodes} "
        f"--forward-fraction {args.forward_fraction:g} --topologies {' '.join(topologies)}"
    )


def cluster_rows(runs: dict[str, Any], shards: int, iters: int) -> dict[str, dict[str, float | None]]:
    """Per method: step times (ms), CPU per step, and per step and rank the bytes on the slow link.

    Both ranks of a node read the node's counter, a moment apart: a node's bytes are the mean of its
    ranks' readings, a rank's the node's over ``shards``; ``link_bytes`` is the mean over the nodes
    (node 0 also carries the rendezvous store's traffic), ``link_bytes_max`` the busiest node's.
    ``cpu_ms``: the CPU time of a rank's process (all threads) per timed step, mean over ranks.
    """
    rows: dict[str, dict[str, float | None]] = {}
    for method, run in runs.items():
        # one dict per rank, in rank order (hsdp_worker.bytes_sent_per_step)
        sent = run["bytes_sent_per_step"]
        readings = [s["link_tx_per_step"] for s in sent]
        nodes = (
            None
            if None in readings
            else [sum(readings[i : i + shards]) / shards / shards for i in range(0, len(readings), shards)]
        )
        windows = [seconds for rank in run["measured"].get("cpu_s", []) for seconds in rank]
        rows[method] = {
            "median_ms": 1e3 * run["median_s"],
            "mean_ms": 1e3 * run["mean_s"],
            "cpu_ms": 1e3 * sum(windows) / len(windows) / iters if windows else None,
            "counted_bytes": max(s["counted"] for s in sent),
            "link_bytes": None if nodes is None else sum(nodes) / len(nodes),
            "link_bytes_max": None if nodes is None else max(nodes),
            "shard_bytes": max(s["shard_bytes"] for s in sent),
        }
    return rows


def cluster_table(
    rows: dict[str, dict[str, float | None]],
    predicted: dict[str, float],
    predicted_with_fsdp: dict[str, float],
    reference: str = REFERENCE,
) -> list[str]:
    """The cluster table: times, ratio to ``reference``, bytes over the slow link, the planner's times."""
    header = ("median ms", f"{reference} / it", "CPU ms", "MB counted", "MB on link", "plan ms")
    header += ("plan+fsdp ms",)
    lines = [f"{'method':<14}" + "".join(f"{h:>16}" for h in header)]
    base = rows.get(reference, {}).get("median_ms")
    for method, row in rows.items():
        link = row["link_bytes"]
        cells = [
            f"{row['median_ms']:.1f}",
            f"{base / row['median_ms']:.3f}" if base else "-",
            "-" if row["cpu_ms"] is None else f"{row['cpu_ms']:.1f}",
            f"{row['counted_bytes'] / 1e6:.3f}",
            "-" if link is None else f"{link / 1e6:.3f}",
            f"{predicted[method]:.1f}" if method in predicted else "-",
            f"{predicted_with_fsdp[method]:.1f}" if method in predicted_with_fsdp else "-",
        ]
        lines.append(f"{method:<14}" + "".join(f"{c:>16}" for c in cells))
    return lines


def cluster_part(args: argparse.Namespace) -> dict[str, Any] | None:
    if not ready_to_emulate():
        return None
    ranks = args.nodes * args.shards
    print(
        f"\ncluster: {args.nodes} nodes x {args.shards} ranks = {ranks} processes on {os.cpu_count()} cores; "
        f"links {args.bandwidth} (tc tbf, both ways); EmulatedMLP {args.inputs}-{args.width}x"
        f"{args.depth - 1}-10, compute {args.compute_ms:g} ms of sleep per step "
        f"({args.forward_fraction:.2f} in forward)",
        flush=True,
    )
    try:
        with Cluster(args.nodes) as emulated:
            emulated.shape(args.bandwidth)
            link = measure_link(emulated, args.link_check_mb, 29701) if args.link_check_mb else None
            print(f"one TCP stream node1->node0: {link or float('nan'):.1f} Mbit/s", flush=True)
            started = time.monotonic()
            # hsdp_worker.py takes cluster_worker.py's flags and runs its rounds with the HSDP methods.
            runs = run_workers(
                emulated, 29711, args.run_seconds, worker_namespace(args), worker_flags(args), worker=WORKER
            )
            wall = time.monotonic() - started
    except RuntimeError as err:
        if "netns" in str(err) or "Operation not permitted" in str(err):
            print(f"skipped: needs root for network namespaces ({err})")
            return None
        raise
    if runs is None:
        print("the workers failed; see the log tail above")
        return {"link_mbit_s": link, "runs": None}
    rows = cluster_rows(runs, args.shards, args.iters)
    shard = max(row["shard_bytes"] or 0 for row in rows.values())
    plan = (list(runs), shard, args.compute_ms, args.bandwidth, args.nodes, args.shards)
    predicted = planner_predictions(*plan, args.forward_fraction)
    # What a step costs here besides the sleeps and the replicas' traffic: FSDP2's gathers and
    # reduce-scatters on loopback, the optimizer, and 8 processes sharing 2 cores.
    fsdp_excess = max(0.0, rows["fsdp"]["median_ms"] - args.compute_ms) if "fsdp" in rows else None
    with_fsdp = {} if fsdp_excess is None else planner_predictions(*plan, args.forward_fraction, fsdp_excess)
    params = next(iter(runs.values()))["params"]
    exchange_ms = 1e3 * shard * args.shards * 8 / rate_bits(args.bandwidth)
    print(
        f"({wall:.0f} s) model {params / 1e6:.2f}M params = {4 * params / 1e6:.2f} MB; shard "
        f"{shard / 1e6:.2f} MB; the node's {args.shards} shards over its link once: {exchange_ms:.0f} ms "
        f"at {args.bandwidth}"
    )
    print(f"\nmedian step times, {args.nodes} nodes x {args.shards} ranks at {args.bandwidth}")
    for line in cluster_table(rows, predicted, with_fsdp):
        print(line)
    print(
        f"{REFERENCE} / it: how many times faster than torch's HSDP; CPU ms: a rank's process CPU per\n"
        "step. MB counted: per rank and step over the slow link (gossip: engine.bytes_sent_per_step();\n"
        f"torch-hsdp: 2(R-1)/R x the rank's fp32 gradient shard, R = {args.nodes} replicas); MB on link:\n"
        f"the node veths' tx_bytes per step / {args.shards} ranks, mean over the nodes, warm-up steps\n"
        "included (a compressed group's first round sends fp32: the reference). plan ms: the planner on\n"
        f"the shard at {args.bandwidth} / {args.shards} per rank (torch-hsdp as its DDP, fsdp as its\n"
        "no-comm); plan+fsdp ms: with the measured fsdp step's excess over the compute "
        f"({fsdp_excess or 0:.1f} ms)\nas overhead. planner command: {planner_command(shard, args)}"
    )
    return {
        "link_mbit_s": link,
        "wall_s": wall,
        "rows": rows,
        "predicted_ms": predicted,
        "predicted_with_fsdp_ms": with_fsdp,
        "fsdp_excess_ms": fsdp_excess,
        "runs": runs,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "memory", "cluster"), default="all")
    parser.add_argument("--shards", type=int, default=2, help="ranks per node, each holding one shard")
    parser.add_argument("--replicas", type=int, default=2, help="memory part: replicas (whole: its ranks)")
    parser.add_argument("--memory-configs", nargs="+", default=list(MEMORY_CONFIGS))
    # MLP 1024-1024x7-10: 7.36M parameters, 29.4 MB in fp32; a few steps are enough to allocate
    # every gradient, optimizer state and gossip buffer.
    parser.add_argument("--mem-inputs", type=int, default=1024)
    parser.add_argument("--mem-width", type=int, default=1024)
    parser.add_argument("--mem-depth", type=int, default=8)
    parser.add_argument("--mem-batch", type=int, default=32)
    parser.add_argument("--mem-steps", type=int, default=4)
    parser.add_argument("--memory-seconds", type=float, default=120.0, help="deadline of one configuration")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument(
        "--bandwidth",
        default="40mbit",
        help="tc rate of every node link, both ways (default 40mbit: the node's two 1.06 MB shards cross it "
        "in 424 ms, about the 400 ms compute)",
    )
    parser.add_argument("--methods", nargs="+", default=list(CLUSTER_METHODS))
    # EmulatedMLP 512-512-512-10: 0.53M parameters, 2.12 MB; a shard of 1.06 MB per rank.
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--compute-ms", type=float, default=400.0, help="sleep per step (forward + backward)")
    parser.add_argument("--forward-fraction", type=float, default=1 / 3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--link-check-mb", type=int, default=5, help="MB of the TCP link check; 0 skips it")
    parser.add_argument("--run-seconds", type=float, default=360.0, help="deadline of the cluster's workers")
    parser.add_argument("--json", metavar="PATH", help="write everything measured as JSON")
    args = parser.parse_args(argv)
    if args.shards < 2 or args.replicas < 2 or args.nodes < 2:
        parser.error("--shards, --replicas and --nodes must be at least 2")
    if min(args.rounds, args.iters, args.mem_steps) < 1 or args.warmup < 0:
        parser.error("--rounds, --iters and --mem-steps must be at least 1, --warmup at least 0")
    for config in args.memory_configs:
        kind, _, wire = config.partition("@")
        if config not in MEMORY_CONFIGS and not (kind in ("whole", "gossip-hsdp") and wire in COMPRESSIONS):
            parser.error(f"--memory-configs: {config!r}: whole, gossip-hsdp (@bf16/fp16/int8) or torch-hsdp")
    for method in args.methods:
        if method not in PLANNER_NAMES:
            try:
                if parse_gossip_method(method)[1]:
                    parser.error(f"--methods: {method!r}: the module front-end is not benchmarked with FSDP2")
            except ValueError as err:
                parser.error(f"--methods: {err}")
    try:
        rate_bits(args.bandwidth)
    except ValueError as err:
        parser.error(f"--bandwidth: {err}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM as an exit: the `finally` blocks stop the workers and remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    record: dict[str, Any] = {"args": vars(args), "cores": os.cpu_count()}
    if args.part in ("all", "memory"):
        record["memory"] = memory_part(args)
    if args.part in ("all", "cluster"):
        record["cluster"] = cluster_part(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
