"""What a job of nodes pays to survive a lost node: the node check, per step.

    uv run benchmarks/faults/run.py node-check                 # 2 nodes x 2 shards on loopback, about 2 min
    uv run benchmarks/faults/run.py node-check --buckets 8 --json /tmp/node-check.json

With ``on_peer_failure="continue"`` a node's ranks all-gather a flag and a count after every gossip
wait, so that they recover together (docs/big-models.md, "A job of nodes"). *Per step*: an FSDP2-sharded
MLP over ``node_mesh()`` (``--buckets`` buckets) with ``"raise"`` against ``"continue"``, interleaved
``--rounds`` times; *one check*: the all-gather alone (``--checks`` times), times the checks per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from benchmarks.harness.common import build_mlp
from benchmarks.harness.fault_runs import run_workers
from decent_optim_wrapper import DecentOptimWrapper, node_mesh


def worker(rank: int, world: int, store: dist.Store, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One rank of an elastic job of nodes (``init_elastic(..., shards=)``, formed by ``run_workers``)."""
    torch.manual_seed(0)
    model = build_mlp(64, args.width, args.depth, 8)
    mesh = node_mesh("cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    optimizer = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        topology="ring",
        on_peer_failure=mode,
        bucket_cap_mb=shard_bytes / args.buckets / 2**20 * 1.01,
        timeout=timedelta(seconds=60),
    )
    times = []
    for step in range(args.steps):
        begin = time.perf_counter()
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * rank + step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        time.sleep(args.step_time)  # the rest of a step's compute
        times.append(time.perf_counter() - begin)
    checks = []
    for _ in range(args.checks):  # the node check's collective, on its own
        flag = torch.zeros(2, dtype=torch.int64)
        gathered = torch.empty(2 * args.shards, dtype=torch.int64)
        begin = time.perf_counter()
        dist.all_gather_into_tensor(gathered, flag, async_op=True).wait(timedelta(seconds=60))
        checks.append(time.perf_counter() - begin)
    step_s, buckets = statistics.median(times[args.warmup :]), len(optimizer.engine.buckets)
    return {"step_s": step_s, "buckets": buckets, "check_s": statistics.median(checks)}


def run_job(args: argparse.Namespace, mode: str) -> dict[str, float]:
    # The launcher hosts the store: with "continue" a rank polls it in every gossip wait, and a store in
    # rank 0 would vanish under the ranks still in their last step.
    world, elastic = args.nodes * args.shards, {"job": "node-check", "shards": args.shards}
    outcome = run_workers(worker, world, (args, mode), deadline_s=300, elastic=elastic)
    if outcome.errors or len(outcome.results) != world:
        raise RuntimeError(f"job {mode}: {outcome.errors or outcome}")
    by_rank = outcome.results
    return {
        "step_s": statistics.median(r["step_s"] for r in by_rank.values()),
        "check_s": statistics.median(r["check_s"] for r in by_rank.values()),
        "buckets": min(r["buckets"] for r in by_rank.values()),
    }


def answer(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Both jobs, interleaved ``--rounds`` times: the step times, one check, and the checks' share."""
    runs: dict[str, list[dict[str, float]]] = {"raise": [], "continue": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(run_job(args, mode))
    step = {mode: statistics.median(r["step_s"] for r in rs) for mode, rs in runs.items()}
    check_s = statistics.median(r["check_s"] for r in runs["continue"])
    buckets = runs["continue"][0]["buckets"]
    figures = {"nodes": args.nodes, "shards": args.shards, "buckets": buckets, "cpus": os.cpu_count()}
    figures |= {"step_s": step, "continue_over_raise": step["continue"] / step["raise"], "check_s": check_s}
    figures["checks_over_step"] = buckets * check_s / step["continue"]
    text = (
        f"{args.nodes} nodes x {args.shards} shards, {buckets} buckets: step "
        f"{step['raise'] * 1e3:.1f} ms with 'raise', {step['continue'] * 1e3:.1f} ms with 'continue' "
        f"({figures['continue_over_raise']:.3f}x); one node check {check_s * 1e6:.0f} us, {buckets} per "
        f"step = {figures['checks_over_step']:.2%} of a step"
    )
    return figures, text
