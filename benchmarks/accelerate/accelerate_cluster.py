"""An Accelerate loop on the emulated cluster's slow links: DDP, LocalSGD every K steps, gossip every K.

    sudo uv run benchmarks/accelerate/accelerate_cluster.py [--bandwidths 200mbit 50mbit] [--json PATH]

The nodes are the emulated cluster's network namespaces (``harness/emulated_cluster.py``: one rank per
node, every link shaped with ``tc tbf``). Every rank runs the same Accelerate loop (``Accelerator(cpu=True)``
from torchrun's environment, as ``accelerate launch`` starts it) on the cluster benchmark's MLP (~1.6M
fp32 parameters, 6.3 MB, AdamW, a batch of ``--batch`` rows), the loop differing only in its
accelerator, once per method in turn, for ``--rounds`` interleaved rounds (``K = --every``):

* ``nocomm``: the same loop without a prepared model (each rank alone): the baseline;
* ``ddp``: ``Accelerator``: DDP, an all-reduce of the gradients every step, overlapped with backward;
* ``local-sgd``: ``Accelerator`` + ``accelerate.local_sgd.LocalSGD(local_sgd_steps=K)``: no gradient
  sync, a blocking exact mean of the parameters every K steps;
* ``gossip-complete``: ``DecentralizedAccelerator(topology="complete", sync_every=K)``: the exact mean
  every K steps, overlapped with the next K steps;
* ``gossip-ring``: ``DecentralizedAccelerator(topology="ring", sync_every=K)``: each rank averages
  with its two ring neighbours every K steps, overlapped.

Each timed window is a multiple of K steps starting on a multiple of K, so every method's share of its
exchanges is the same. Reported per bandwidth: each method's median step time over no communication's,
and DDP's and LocalSGD's over it. Needs root; without it, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.cluster_worker import write_atomically
from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_cluster import (
    Cluster,
    rate_bits,
    ready_to_emulate,
    run_workers,
)

METHODS = ("nocomm", "ddp", "local-sgd", "gossip-complete", "gossip-ring")


# -- one rank (run inside its node by run_workers) ----------------------------------------------------
def train_segment(method: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """``--warmup`` then ``--iters`` timed steps of the loop with ``method``: (seconds per step, bytes
    this rank sends per step)."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    torch.manual_seed(0)
    model = build_mlp(args.inputs, args.width, args.depth, 10)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if method.startswith("gossip"):
        topology = method.split("-", 1)[1]
        accelerator = DecentralizedAccelerator(cpu=True, topology=topology, sync_every=args.every)
    else:
        accelerator = Accelerator(cpu=True)
    if method != "nocomm":
        model, optimizer = accelerator.prepare(model, optimizer)
    synced: Any = contextlib.nullcontext()
    if method == "local-sgd":
        synced = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.every)
    generator = torch.Generator().manual_seed(args.rank)
    x = torch.randn(args.batch, args.inputs, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    times = []
    with synced:
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                torch.distributed.barrier()  # every rank starts the timed window together
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if method == "local-sgd":
                synced.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    model_bytes = 4 * sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    ring_all_reduce = model_bytes * 2 * (args.world_size - 1) / args.world_size
    if method.startswith("gossip"):
        sent = accelerator.replicas.wrappers[0].engine.bytes_sent_per_step()
        accelerator.global_avg(may_revert=False)  # finishes the last round; untimed
    else:
        sent = {"nocomm": 0.0, "ddp": ring_all_reduce, "local-sgd": ring_all_reduce / args.every}[method]
    torch.distributed.barrier()
    return times, sent


def run_rank(args: argparse.Namespace) -> None:
    """Every method once per round, round ``r`` starting at method ``r``; ``--out`` after every round."""
    os.environ.update(
        RANK=str(args.rank),
        LOCAL_RANK=str(args.rank % args.local_world_size),
        WORLD_SIZE=str(args.world_size),
        LOCAL_WORLD_SIZE=str(args.local_world_size),
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    sent: dict[str, float] = {}
    rounds = []
    train_segment("nocomm", argparse.Namespace(**{**vars(args), "iters": 2}))  # lazy imports, allocator
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]
        medians = {}
        for method in order:
            segment, sent[method] = train_segment(method, args)
            times[method].extend(segment)
            medians[method] = statistics.median(segment)
        rounds.append(medians)
        record = {"params": 0, "times": times, "round_medians": rounds, "bytes_sent_per_step": sent}
        write_atomically(args.out, record)
    torch.distributed.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------------
def sweep(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    """Every method at every bandwidth."""
    results = {}
    for index, bandwidth in enumerate(args.bandwidths):
        cluster.shape(None if bandwidth == "unlimited" else bandwidth)
        worker_flags = ["--every", str(args.every), "--inputs", str(args.inputs), "--width", str(args.width)]
        runs = run_workers(
            cluster, 29711 + index, args.run_seconds, args, worker_flags, worker=Path(__file__)
        )
        results[bandwidth] = runs or {}
        for method, run in (runs or {}).items():
            rounds = " ".join(f"{1e3 * t:.0f}" for t in run["round_medians_s"])
            print(
                f"{bandwidth} {method:<16} median {1e3 * run['median_s']:7.1f} ms  rounds {rounds}",
                flush=True,
            )
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    model_bytes = 4 * sum(p.numel() for p in build_mlp(args.inputs, args.width, args.depth, 10).parameters())
    lines = [
        f"{args.nodes} nodes x 1 rank (gloo, one torch thread each, on {os.cpu_count()} cores), MLP of "
        f"{model_bytes / 1e6:.1f} MB, AdamW, batch {args.batch}, K = {args.every}; medians over "
        f"{args.rounds} rounds x {args.iters} steps",
        "",
        "| link | one model over one link | method | ms per step | / nocomm | DDP / it | LocalSGD / it "
        "| MB sent per step and rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bandwidth, runs in results.items():
        if "nocomm" not in runs:
            continue
        exchange = (
            "-" if bandwidth == "unlimited" else f"{1e3 * model_bytes * 8 / rate_bits(bandwidth):.0f} ms"
        )
        median = {m: run["median_s"] for m, run in runs.items()}
        for method, run in runs.items():
            ratios = [median[method] / median["nocomm"]] + [
                median[ref] / median[method] if ref in median else float("nan")
                for ref in ("ddp", "local-sgd")
            ]
            sent = max(run["bytes_sent_per_step"]) / 1e6
            lines.append(
                f"| {bandwidth} | {exchange} | {method} | {1e3 * median[method]:.0f} | "
                + " | ".join(f"{v:.2f}" for v in ratios)
                + f" | {sent:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--every", type=int, default=8, help="K: LocalSGD's local_sgd_steps, gossip's sync_every"
    )
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="rows per rank and step")
    parser.add_argument(
        "--iters", type=int, default=24, help="timed steps per method and round (a multiple of K)"
    )
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (a multiple of K)")
    parser.add_argument("--rounds", type=int, default=3)
    # worker flags (run_workers passes them to each rank)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--local-world-size", type=int, default=1)
    parser.add_argument("--out")
    # driver flags
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--bandwidths", nargs="+", default=["200mbit", "50mbit"])
    parser.add_argument("--run-seconds", type=float, default=900.0, help="deadline of one bandwidth's run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--table", help="write the table here")
    args = parser.parse_args(argv)
    if args.iters % args.every or args.warmup % args.every:
        parser.error(f"--iters and --warmup must be multiples of --every ({args.every})")
    args.workers_per_node = 1
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.rank is not None:
        run_rank(args)
        return
    if "nocomm" not in args.methods:
        sys.exit("--methods must include nocomm: every ratio is to its step time")
    if not ready_to_emulate():
        return
    with Cluster(args.nodes) as cluster:
        results = sweep(cluster, args)
    text = report(results, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.table:
        Path(args.table).write_text(text + "\n")


if __name__ == "__main__":
    main()
